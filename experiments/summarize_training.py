"""Builds results/training-smollm2.md from the runs of configs/smollm2/{gdn-w56-s8-shortconv,gla,gdn}.toml.

    python experiments/summarize_training.py      # after the three `linjax train` runs and the perplexity JSONs

Copies each run's metrics.jsonl next to this file (runs/ is not versioned) and
tabulates WikiText-2 perplexity (results/wikitext2/*.json, from `linjax eval perplexity`).
"""

import json
import os
import shutil
import statistics

from linjax.files import write_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "results")  # what it reads and writes
RUNS = {"gdn-w56-s8-shortconv": "GDN + window 56 + sinks 8 + short conv", "gla": "GLA (pure)", "gdn": "GDN (pure)"}


def perplexity(name):
    path = os.path.join(HERE, "wikitext2", f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["results"][0]


def main():
    original = perplexity("original")
    lines = ["# Training SmolLM2-135M on CPU: three linearizations at the same budget", "",
             "Each run: `linjax train configs/smollm2/<name>.toml` — 200 steps of 1 × 1,024 packed tokens "
             "from `../shared/data/webtext` and the Paul Graham essays, AdamW lr 2e-3, 20 warm-up steps then "
             "cosine decay, seed 1, only the new parameters trained (2 CPU cores).", "",
             f"Perplexity: WikiText-2 raw test, the first {original['windows']} non-overlapping windows of 1,024 "
             f"tokens ({original['tokens']:,} scored tokens of 301,948), `linjax eval perplexity ... "
             "--seq-len 1024 --max-windows 64`.", "",
             "| model | steps done | perplexity before training | after training | "
             "train loss, first 20 steps | last 20 steps | median tokens/s |", "|---|---|---|---|---|---|---|",
             f"| original SmolLM2-135M (full attention) | — | {original['perplexity']:.2f} | — | — | — | — |"]
    for name, title in RUNS.items():
        run_dir = os.path.join(ROOT, "runs", f"smollm2-{name}")
        metrics = os.path.join(run_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            shutil.copyfile(metrics, os.path.join(HERE, "training", f"{name}-metrics.jsonl"))
        copied = os.path.join(HERE, "training", f"{name}-metrics.jsonl")
        with open(copied) as f:
            records = [json.loads(line) for line in f if line.strip()]
        before, after = perplexity(f"{name}-before"), perplexity(f"{name}-after")
        fmt = lambda r: f"{r['perplexity']:.2f}" if r else "not measured"  # noqa: E731
        first = statistics.mean(r["loss"] for r in records[:20])
        last = statistics.mean(r["loss"] for r in records[-20:])
        speed = statistics.median(r["tokens_per_s"] for r in records[1:])
        lines.append(f"| {title} | {len(records)} steps | {fmt(before)} | {fmt(after)} | {first:.3f} | {last:.3f} | "
                     f"{speed:.0f} |")
    write_text(os.path.join(HERE, "training-smollm2.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "training"), exist_ok=True)
    main()
