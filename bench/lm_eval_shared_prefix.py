"""lm-eval time with SharedPrefixHFLM against lm-eval's HFLM, on the same tasks and model.

    python bench/lm_eval_shared_prefix.py [--model runs/smollm2-hf] [--tasks mmlu_anatomy,hellaswag]
        [--limit 100] [--data-dir ../shared/data] [--out results/bench/lm_eval_shared_prefix.json]

Runs `linjax eval lm-eval` once with each scorer (HFLM with --batch-size, then SharedPrefixHFLM),
one task at a time, and reports seconds per task and every metric of both: the metrics must
agree (the scores are the same log-likelihoods up to float rounding). Prints a Markdown table and
writes JSON. Pin it to the cores you mean to measure (e.g. `taskset -c 0`, OMP_NUM_THREADS=1).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

# Run as a script, bench/ is sys.path[0], and bench/kernels.py would shadow the PyPI `kernels`
# package that transformers probes for at import. The benchmarks import only installed packages.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from linjax.eval import lm_eval_bridge  # noqa: E402
from linjax.files import write_json  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="runs/smollm2-hf", help="an exported HF directory or anything lm-eval takes")
    parser.add_argument("--tasks", default="mmlu_anatomy,hellaswag")
    parser.add_argument("--limit", type=float, default=100)
    parser.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))
    parser.add_argument("--batch-size", type=int, default=16, help="HFLM's batch size")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "bench",
                                                      "lm_eval_shared_prefix.json"))
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    runs = {}
    for name, share in (("HFLM", False), ("SharedPrefixHFLM", True)):
        with tempfile.TemporaryDirectory() as out:
            runs[name] = lm_eval_bridge.run(args.model, tasks=tasks, data_dir=args.data_dir, limit=args.limit,
                                            batch_size=args.batch_size, out_dir=out, share_prefixes=share)
    rows = []
    for task in tasks:
        hflm, shared = (runs[n]["results"][task] for n in ("HFLM", "SharedPrefixHFLM"))
        metrics = {k.split(",")[0]: (hflm[k], shared[k]) for k in hflm
                   if "," in k and "_stderr" not in k and isinstance(hflm[k], float)}
        seconds = [runs[n]["seconds_per_task"][task] for n in ("HFLM", "SharedPrefixHFLM")]
        rows.append({"task": task, "examples": runs["HFLM"]["n-samples"][task]["effective"],
                     "seconds_hflm": seconds[0], "seconds_shared_prefix": seconds[1],
                     "speedup": seconds[0] / seconds[1], "metrics": metrics})
    print("| task | examples | HFLM s | SharedPrefixHFLM s | speed-up | metrics (HFLM / shared) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        metrics = ", ".join(f"{m} {a:.4f} / {b:.4f}" for m, (a, b) in r["metrics"].items())
        print(f"| {r['task']} | {r['examples']} | {r['seconds_hflm']:.1f} | {r['seconds_shared_prefix']:.1f} | "
              f"{r['speedup']:.1f}× | {metrics} |")
    write_json(args.out, {"model": args.model, "limit": args.limit, "batch_size_hflm": args.batch_size,
                          "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "rows": rows})
    print(f"→ {args.out}")


if __name__ == "__main__":
    main()
