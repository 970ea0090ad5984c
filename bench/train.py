"""Training throughput: tokens/s of one jitted training step on smollm2-135m (this machine).

    python bench/train.py [--seq-lens 1024,4096] [--repeats 3] [--out results/bench/train.json]

For GDN + window 56 + sinks 8 + short conv (the paper's final recipe) and for
pure GLA: state placed as `linjax train` places it, one compiling step and one
warm-up step, then `--repeats` timed steps (median), batch 1.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

# Run as a script, bench/ is sys.path[0], and bench/kernels.py would shadow the PyPI `kernels`
# package that transformers probes for at import. The benchmarks import only installed packages.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import jax
import numpy as np
from flax import nnx

import linjax
from linjax.layers import Trainable
from linjax.train.config import TrainSection
from linjax.train.loop import make_optimizer, make_train_step
from linjax.train import sharding

SETTINGS = {
    "gdn+w56+s8+shortconv": linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv"),
    "gla (pure)": linjax.LinearizeConfig(mechanism="gla", window=0, sinks=0),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench/train.json")
    args = parser.parse_args()
    base, _ = linjax.load("smollm2-135m")
    mesh = sharding.make_mesh()
    rows = []
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
               "backend": jax.default_backend()}
    # Short sequences first, and the JSON rewritten after every row: a long sequence that runs
    # out of memory (the kernel kills the process) leaves the rows measured before it.
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for name, config in SETTINGS.items():
            model = linjax.linearize(base, config, seed=1)
            graphdef, trainable, frozen = nnx.split(model, Trainable, ...)
            frozen = sharding.shard_frozen(frozen, mesh)
            optimizer, _ = make_optimizer(TrainSection(steps=100, seq_len=seq_len, warmup_steps=10), config.adapter)
            step = make_train_step(graphdef, optimizer, "ce", mesh)
            # Placed exactly as the training loop places them: otherwise the second call recompiles.
            state = (sharding.replicate(jax.tree.map(lambda x: x.copy(), trainable), mesh),
                     sharding.replicate(optimizer.init(trainable), mesh))
            batch = sharding.put_batch(
                np.random.default_rng(0).integers(0, base.config.vocab_size, (1, seq_len), dtype=np.int32), mesh)
            start = time.perf_counter()
            *state, metrics = step(*state, frozen, batch)
            jax.block_until_ready(metrics)
            compile_s = time.perf_counter() - start
            *state, metrics = step(*state, frozen, batch)  # warm-up: first-touch allocations
            jax.block_until_ready(metrics)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                *state, metrics = step(*state, frozen, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
            median = statistics.median(times)
            rows.append({"setting": name, "seq_len": seq_len, "step_s": median, "tokens_per_s": seq_len / median,
                         "first_step_s": compile_s, "repeats": args.repeats})
            print(f"{name} L={seq_len}: {median:.2f} s/step, {seq_len / median:.0f} tokens/s", flush=True)
            _write_json(args.out, {"machine": machine, "rows": rows})
    print("\n| setting | seq len | s / step | tokens / s | first step (compile) s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['seq_len']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | {r['first_step_s']:.1f} |")
    print(f"wrote {args.out}")


def _write_json(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
