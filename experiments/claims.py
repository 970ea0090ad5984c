"""The paper's claims at this machine's scale: train and evaluate the claims rows, then write results/claims.md.

    python experiments/claims.py status                     # where each row stands
    python experiments/claims.py evaluate ROW [ROW ...]     # its evaluations, into results/runs/ROW/eval/
    python experiments/claims.py evaluate-paired ROW ROW    # whole-file WikiText-2 of both, window by window
    python experiments/claims.py run ROW [ROW ...] [--jobs N] [--only EVALS] [--set section.key=value ...]
                                                            # train (resuming) then evaluate each, N at a time
    python experiments/claims.py report                     # results/claims.md and the README's results block
    python experiments/claims.py data                       # count the training text (results/runs/training-data.json)

The rows and the claims between them are data, experiments/claims.toml; a row is configs/claims/ROW.toml,
trained into results/runs/ROW/ (`linjax train configs/claims/ROW.toml [--resume]`), except the untrained
ones (the original model, the window-only baselines). A two-stage row's config starts from its first
stage's run (`train.init_from`); `run` trains the stages in order. Every row is evaluated on the same data:
WikiText-2 test perplexity (the first 64 windows of 1,024 tokens; `perplexity-full`: the whole file, every
token once, with per-window results for the paired bootstrap), LAMBADA (OpenAI) accuracy and perplexity
(the first 1,000 examples, lm-eval through `linjax eval lm-eval`; `lambada-full`: all 5,153 scored in JAX
by `linjax eval lambada`, per-example results in eval/lambada-full.json, whose first 1,000 stand in for
lm-eval's where a row has no lm-eval run), S-NIAH-1/2 at 1k and 2k tokens (10 samples each), per-layer
and per-token nMSE against the original on Clean Alpaca (8 x 512 tokens). An evaluation already written
is not run again.

The output-scale and gate-bias ablation (configs/claims/ablation/, 300 steps x 512 tokens each) is
trained with `linjax train configs/claims/ablation/NAME.toml` and scored with `linjax eval perplexity`
on the same 64 WikiText-2 windows into results/runs/ablation/NAME/eval/wikitext2.json; `report` adds
its table to claims.md.

The modules: claims_data.py (the rows, their files and what they measured), claims_run.py (training
and evaluating them), stats.py (the statistics, shared with the other experiments), claims_report.py
(claims.md and the README's block).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root holds the `experiments` package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import claims_report, claims_run  # noqa: E402


def main(argv=None):
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
    run.add_argument("--only", default=claims_run.RUN_EVALUATIONS,
                     help=f"evaluations after training ({claims_run.RUN_EVALUATIONS}; \"\": none, train only)")
    run.add_argument("--set", action="append", default=[], metavar="section.key=value",
                     help="passed to `linjax train` (model.dtype=float32 keeps a GPU run at the CPU rows' precision)")
    report = sub.add_parser("report", help="results/claims.md, and the README's results block between its markers")
    report.add_argument("--no-readme", action="store_true", help="leave README.md alone")
    sub.add_parser("data", help="count the training text's documents and tokens into results/runs/training-data.json")
    args = parser.parse_args(argv)
    if args.command == "evaluate":
        claims_run.evaluate(args.rows, set(filter(None, args.only.split(","))))
    elif args.command == "evaluate-paired":
        claims_run.evaluate_paired(args.rows)
    elif args.command == "run":
        sys.exit(1 if claims_run.run_rows(args.rows, args.only, args.jobs, args.set) else 0)
    elif args.command == "report":
        claims_report.report(readme=None if args.no_readme else claims_report.README)
    elif args.command == "data":
        claims_run.count_training_data()
    else:
        claims_run.status()


if __name__ == "__main__":
    main()
