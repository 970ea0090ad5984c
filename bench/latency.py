"""Decode latency and peak memory against prompt length: full attention with a KV cache vs the linearized model.

    python bench/latency.py [--lengths 1024,2048,4096,8192,16384,32768] [--implementations full,linearized,transformers]
                            [--real-prefill] [--threads N] [--out results/bench/latency]

The paper's protocol (batch 8, prompt of L tokens, 16 greedy decode steps timed end to end, peak
memory) for linjax full attention, the linearized model (GDN + window 56 + sinks 8 + short conv)
and transformers' own model; each point in its own process. The same as `linjax bench latency`;
the work is in linjax/eval/latency.py. Prints progress and a Markdown table; writes latency.json,
latency.md and latency.png to --out.
"""

from __future__ import annotations

import argparse
import os
import sys

# Run as a script, bench/ is sys.path[0], and bench/kernels.py would shadow the PyPI `kernels`
# package that transformers probes for at import. The benchmarks import only installed packages.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from linjax.app import latency_cli


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    latency_cli.add_arguments(parser)
    try:
        latency_cli.main(parser.parse_args())
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
