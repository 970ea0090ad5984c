"""The options of `linjax bench latency` and `bench/latency.py` (one definition for both); the
benchmark itself is linjax/eval/latency.py."""

from __future__ import annotations

import argparse
import os

from linjax.app.arguments import argument_type, non_negative_int, positive_float, positive_int
from linjax.eval import latency
from linjax.linearize import RETAIN_SCORES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=argument_type(latency.parse_lengths),
                        default=",".join(map(str, latency.DEFAULT_LENGTHS)), help="prompt lengths L")
    parser.add_argument("--implementations", type=argument_type(latency.parse_implementations),
                        default=",".join(latency.DEFAULT_IMPLEMENTATIONS),
                        help=f"comma-separated, from: {', '.join(latency.IMPLEMENTATIONS)} (default: "
                             f"{','.join(latency.DEFAULT_IMPLEMENTATIONS)})")
    parser.add_argument("--retain", type=positive_int,
                        help=f"tokens kept for their content per layer and kv head by the 'retained' implementation "
                             f"(default {latency.DEFAULT_RETAIN}; docs/retention.md)")
    parser.add_argument("--retain-score", choices=list(RETAIN_SCORES),
                        help="what 'retained' scores a token leaving the window by "
                             f"(default {latency.DEFAULT_RETAIN_SCORE})")
    parser.add_argument("--batch", type=positive_int, default=latency.BATCH)
    parser.add_argument("--decode-tokens", type=positive_int, default=latency.DECODE_TOKENS)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per point (the median is reported)")
    parser.add_argument("--model", default=latency.DEFAULT_MODEL, help="anything linjax.load reads (full attention)")
    parser.add_argument("--hf-dir", help="its transformers directory (default: runs/smollm2-hf for smollm2-135m, "
                                         "or --model if it is one); exported there if absent")
    parser.add_argument("--real-prefill", action="store_true",
                        help="run the real prefill instead of the random stand-in (slow on a CPU at large L)")
    parser.add_argument("--memory-limit-gb", type=positive_float,
                        help="do not start a KV-cache point whose cache exceeds this many GiB (default: the host's "
                             "MemAvailable at that moment; on a GPU, pass its memory)")
    parser.add_argument("--threads", type=positive_int, help="cores for each point's process, torch and XLA alike "
                                                          "(default: all; 1 keeps a busy machine from thrashing)")
    parser.add_argument("--timeout-s", type=positive_float, help="give up on a point after this long")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--out", default=os.path.join("bench", "results", "latency"),
                        help="output directory: latency.json, latency.md, latency.png")


def main(args: argparse.Namespace) -> dict:
    """Runs the benchmark from parsed `add_arguments` options and prints the table."""
    limit = None if args.memory_limit_gb is None else int(args.memory_limit_gb * latency.GIB)
    result = latency.run(implementations=args.implementations, lengths=args.lengths, batch=args.batch,
                         decode_tokens=args.decode_tokens, repeats=args.repeats, model=args.model,
                         hf_dir=args.hf_dir, real_prefill=args.real_prefill, memory_limit_bytes=limit,
                         threads=args.threads, timeout_s=args.timeout_s, seed=args.seed,
                         out_dir=args.out, progress=lambda line: print(line, flush=True), retain=args.retain,
                         retain_score=args.retain_score)
    print("\n" + latency.markdown(result))
    print(f"→ {os.path.join(args.out, 'latency.json')}, latency.md, latency.png")
    return result
