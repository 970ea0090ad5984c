"""report.md for a `linjax run` directory: what was trained, how it trained, how it evaluates.

Built only from the files the stages wrote (stages/*.json, metrics.jsonl and the
evaluations' own outputs), so it can be rewritten at any time without rerunning anything.
"""

from __future__ import annotations

import json
import os

import numpy as np

from linjax.files import pyplot, write_figure, write_text


def _loss_plot(run_dir: str) -> str | None:
    """training_loss.png from metrics.jsonl (raw and a 10-step moving average)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    plt = pyplot()
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = np.array([r["step"] for r in records])
    loss = np.array([r["loss"] for r in records])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, lw=0.8, alpha=0.5, label="loss")
    if len(loss) >= 10:
        ax.plot(steps[9:], np.convolve(loss, np.ones(10) / 10, mode="valid"), lw=1.8, label="10-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy")
    ax.legend()
    return os.path.basename(write_figure(fig, os.path.join(run_dir, "training_loss.png")))


def _section_skipped(title: str, result) -> list[str] | None:
    if result is None:
        return [f"## {title}", "", "Not run (not in `eval.run`, or the run stopped before it).", ""]
    if "skipped" in result:
        return [f"## {title}", "", f"Skipped: {result['skipped']}.", ""]
    return None


def _perplexity_lines(result) -> list[str]:
    lines = ["## Perplexity", "", f"Held-out text: `{os.path.basename(result['data'])}`, non-overlapping windows "
             f"of {result['seq_len']} tokens.", "", "| model | perplexity | tokens scored |", "|---|---|---|"]
    for name, row in result["rows"].items():
        lines.append(f"| {name} | {row['perplexity']:.2f} | {row['tokens']:,} |")
    return lines + [""]


def _approx_lines(result, run_dir) -> list[str]:
    lines = ["## Approximation error", "",
             "Per-layer error of each linearized attention block against the original softmax attention "
             "on the same input (the paper's appendix, \"Approximation error\").", ""]
    layers = result.get("per_layer") or []
    if layers:
        keys = [k for k in ("mse", "nmse") if k in layers[0]]
        lines += ["| layer | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for i, row in enumerate(layers):
            lines.append(f"| {row.get('layer', i)} | " + " | ".join(f"{row[k]:.4g}" for k in keys) + " |")
        lines.append("")
    for plot in result.get("plots", []):
        lines.append(f"![{os.path.basename(plot)}]({os.path.relpath(plot, run_dir)})")
    return lines + [""]


def _metric_rows(results: dict, tasks) -> dict:
    """{(task, metric): value} of lm-eval results (no stderr or alias entries)."""
    rows = {}
    for task in tasks:
        for key, value in (results.get(task) or {}).items():
            if "," in key and "_stderr" not in key and not key.startswith("alias"):
                rows[(task, key.split(",", 1)[0])] = value
    return rows


def _lm_eval_lines(result) -> list[str]:
    lines = ["## lm-eval (limited)", ""]
    if result.get("limit"):
        lines += [f"At most {result['limit']} examples per task (local task files): a check that the exported "
                  "PyTorch model runs and roughly where it stands, not a benchmark figure.", ""]
    models = result.get("models") or {"linearized, trained": result}  # older stage files: one model
    per_model = {name: _metric_rows(r.get("results") or {}, result.get("tasks") or r.get("tasks") or [])
                 for name, r in models.items()}
    keys = list(dict.fromkeys(k for rows in per_model.values() for k in rows))
    lines += ["| task | metric | " + " | ".join(per_model) + " |", "|---|---|" + "---|" * len(per_model)]
    for task, metric in keys:
        cells = [f"{per_model[m][(task, metric)]:.4f}" if (task, metric) in per_model[m] else "—" for m in per_model]
        lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
    return lines + [""]


def _ruler_lines(result) -> list[str]:
    lines = ["## Long context (RULER)", "",
             "RULER's synthetic tasks (niah_single_*: one needle), greedy decoding, string match; accuracy over "
             "the samples. "
             "\"window only\" is the original model restricted to the same sinks + window softmax with no "
             "linear state: what the linear state adds is the difference between it and the linearized model.", "",
             "| task | length | model | cache | accuracy | samples |", "|---|---|---|---|---|---|"]
    models = result.get("models") or {"linearized, trained": result}
    for name, r in models.items():
        for row in r.get("results") or []:
            lines.append(f"| {row['task']} | {row['length']} | {name} | {row['variant']} | {row['accuracy']:.2f} | "
                         f"{row['samples']} |")
    return lines + [""]


def _usable(result) -> bool:
    return bool(result) and "skipped" not in result


def _summary_lines(stages: dict) -> list[str]:
    """The headline figures of each evaluation that ran, one bullet each."""
    lines = []
    perplexity = stages.get("perplexity")
    if _usable(perplexity):
        rows = ", ".join(f"{name} {row['perplexity']:.2f}" for name, row in perplexity["rows"].items())
        lines.append(f"- Perplexity ({os.path.basename(perplexity['data'])}): {rows}.")
    approx = stages.get("approx")
    if _usable(approx) and approx.get("per_layer"):
        nmse = [row["nmse"] for row in approx["per_layer"]]
        worst = max(range(len(nmse)), key=nmse.__getitem__)
        worst_layer = approx["per_layer"][worst].get("layer", worst)
        lines.append(f"- Attention approximation error: mean nMSE {sum(nmse) / len(nmse):.3g} over "
                     f"{len(nmse)} layers, worst {nmse[worst]:.3g} (layer {worst_layer}).")
    lm_eval = stages.get("lm_eval")
    if _usable(lm_eval):
        models = lm_eval.get("models") or {"linearized, trained": lm_eval}
        means = []
        for name, r in models.items():
            accs = [v for (task, metric), v in _metric_rows(r.get("results") or {}, lm_eval.get("tasks") or []).items()
                    if metric == "acc"]
            if accs:
                means.append(f"{name} {sum(accs) / len(accs):.3f}")
        if means:
            lines.append(f"- lm-eval mean accuracy over {len(lm_eval.get('tasks') or [])} tasks (limit "
                         f"{lm_eval.get('limit')}): " + ", ".join(means) + ".")
    ruler = stages.get("ruler")
    if _usable(ruler):
        parts = []
        for name, r in (ruler.get("models") or {"linearized, trained": ruler}).items():
            rows = r.get("results") or []
            if rows:
                parts.append(f"{name} {sum(row['accuracy'] for row in rows) / len(rows):.2f}")
        if parts:
            lines.append("- RULER mean accuracy: " + ", ".join(parts) + ".")
    return (["## Summary", ""] + lines + [""]) if lines else []


def write_report(config, run_dir: str, stages: dict) -> str:
    """Writes RUN_DIR/report.md from the stage results; returns its path."""
    lin = config.linearize
    convert, train = stages.get("convert") or {}, stages.get("train") or {}
    lines = [f"# linjax run: {os.path.basename(run_dir)}", ""]
    if convert:
        lines += [f"Base model `{convert['source']}`: {convert['architecture']}, {convert['parameters'] / 1e6:.1f}M "
                  f"parameters, {convert['layers']} layers.", ""]
    lines += [f"Linearized with **{lin.mechanism}**, window {lin.window}, sinks {lin.sinks}, adapter "
              f"{lin.adapter or 'none'}, full-attention layers kept: {list(lin.keep_full_attention) or 'none'}.", ""]
    lines += _summary_lines(stages)
    if train:
        tc = config.train
        lines += ["## Training", "",
                  f"{train['steps']} steps of {tc.batch_size} × {tc.seq_len} packed tokens, "
                  f"objective `{tc.objective}`, "
                  f"only the new parameters trained. Loss {train['first_loss']:.3f} at step 1, "
                  f"{train['mean_loss_last_10']:.3f} averaged over the last {min(10, train['steps'])} steps; "
                  f"{train['median_tokens_per_s']:.0f} tokens/s (median), {train['seconds'] / 60:.1f} min. "
                  "Each step's loss is measured on a different batch, so it moves with the kind of text in "
                  "that batch as much as with training; held-out perplexity below is the comparison.", ""]
        plot = _loss_plot(run_dir)
        if plot:
            lines += [f"![training loss]({plot})", ""]
    sections = (("Perplexity", "perplexity", lambda r: _perplexity_lines(r)),
                ("Approximation error", "approx", lambda r: _approx_lines(r, run_dir)),
                ("lm-eval (limited)", "lm_eval", lambda r: _lm_eval_lines(r)),
                ("Long context (RULER)", "ruler", lambda r: _ruler_lines(r)))
    for title, stage, render in sections:
        if stage not in config.eval.run:
            continue
        result = stages.get(stage)
        lines += _section_skipped(title, result) or render(result)
    timing = [f"{s} {stages[s]['seconds'] / 60:.1f} min" for s in stages if stages.get(s) and "seconds" in stages[s]]
    lines += ["## Time", "", "; ".join(timing) + ".", ""]
    path = os.path.join(run_dir, "report.md")
    write_text(path, "\n".join(lines))
    return path
