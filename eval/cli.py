"""`linjax eval ...`: one subcommand per evaluation; each writes its results to files.

    linjax eval perplexity MODEL [MODEL ...] --data FILE [--seq-len 1024] [--max-windows N] [--out F.json]

MODEL: see `linjax.eval.models.load_model`.
"""

from __future__ import annotations

import json
import os
import time


def write_json(path: str, data) -> None:
    """Atomic JSON write (a crash never leaves half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def _perplexity(args):
    from linjax.eval.models import load_model
    from linjax.eval.perplexity import perplexity, token_windows

    with open(args.data, encoding="utf-8") as f:
        text = f.read()
    rows = []
    for spec in args.models:
        model, tokenizer, description = load_model(spec, args.dtype)
        if tokenizer is None:
            raise ValueError(f"{spec} has no tokenizer; perplexity needs one to read {args.data}")
        windows = token_windows(tokenizer, text, args.seq_len, args.max_windows)
        start = time.perf_counter()
        result = perplexity(model, windows, batch_size=args.batch_size, progress=True)
        result.update(model=description, seconds=time.perf_counter() - start)
        rows.append(result)
        print(f"{description}: perplexity {result['perplexity']:.3f} over {result['tokens']} tokens "
              f"({result['windows']} windows of {args.seq_len})", flush=True)
        if args.out:  # after every model, so a long comparison loses nothing on a crash
            write_json(args.out, {"data": os.path.abspath(args.data), "seq_len": args.seq_len,
                                  "max_windows": args.max_windows, "results": rows})
    print("\n| model | perplexity | tokens |\n|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['perplexity']:.3f} | {r['tokens']} |")


def add_eval_parser(sub) -> None:
    """Registers `linjax eval` and its subcommands on the top-level subparsers."""
    parser = sub.add_parser("eval", help="evaluate a model (perplexity, ...)")
    evals = parser.add_subparsers(dest="evaluation", required=True)

    p = evals.add_parser("perplexity", help="perplexity on a text file in non-overlapping windows")
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="smollm2-135m, a checkpoint or run directory, ..., or an experiment TOML "
                        "(its linearized model before training)")
    p.add_argument("--data", required=True, help="a UTF-8 text file, e.g. WikiText-2 test")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--out", help="JSON file for the results")
    p.set_defaults(func=_perplexity)
