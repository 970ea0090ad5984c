"""Time `linjax train`'s step as the claims rows take it, without the model file: SmolLM2-135M's shapes with
random weights, each claims config given (by default the final recipe: GDN + window 56 + sinks 8 + short
conv) with its own objective and trained parameters, at 1 x 512 tokens, fp32; one line per combination
of config, kernel, remat and matmul precision (compilation, first and median step, the loss after the
steps, which settings computing the same function share to a few digits).

    python bench/lent_gpu/probe.py [--configs configs/claims/lolcats-at.toml,...] [--kernels chunked,pallas]
                                   [--remats auto,none] [--precisions highest]

On a lent GPU, run it in the first call (docs/gpu.md) to choose the claims rows' settings for the second.
With `--configs configs/claims/lolcats-at.toml` it times LoLCATs' attention-transfer step, the stage that
wrote no step in 8 minutes on the H200 (results/bench/gpu-train-2026-11-27.md): compilation or stepping.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

T0 = time.perf_counter()
BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)  # for gpu_check's random_model

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_check import model_shapes, random_model  # noqa: E402

import linjax  # noqa: E402
from linjax.experiment import load_experiment  # noqa: E402
from linjax.train import sharding  # noqa: E402
from linjax.train.loop import make_optimizer, make_train_step, place_train_state, trained_parameters  # noqa: E402


def say(*parts):
    print(f"[{time.perf_counter() - T0:6.1f} s]", *parts, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="configs/claims/gdn-w56-s8-shortconv.toml",
                        help="comma-separated claims configs (their [linearize] and [train] settings)")
    parser.add_argument("--kernels", default="chunked", help="comma-separated: chunked, pallas")
    parser.add_argument("--remats", default="auto", help="comma-separated: auto, none, layer, full")
    parser.add_argument("--precisions", default="highest", help="comma-separated: highest, tensorfloat32, ...")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    say("devices", jax.devices())
    base = random_model(model_shapes("smollm2-135m", False), jnp.float32, 30)
    say("random weights")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 49152, (1, 512)), jnp.int32)
    mesh = sharding.make_mesh()
    for path, kernel, remat, precision in itertools.product(*(a.split(",") for a in (
            args.configs, args.kernels, args.remats, args.precisions))):
        config = load_experiment(path, [f"linearize.kernel={kernel}", f"train.remat={remat}",
                                        "train.batch_size=1", "train.seq_len=512"])
        settings, recipe = config.train, config.linearize
        model = linjax.linearize(base, recipe, seed=1)
        optimizer, _ = make_optimizer(settings, recipe.adapter)
        graphdef, trainable, opt_state, frozen, _ = place_train_state(model, optimizer, mesh)
        with jax.default_matmul_precision(precision):
            step = make_train_step(graphdef, optimizer, settings.objective, mesh, remat=settings.remat_policy(),
                                   loss_chunk=settings.loss_chunk_size(),
                                   trains=trained_parameters(trainable, settings.trainable))
            start = time.perf_counter()
            compiled = step.lower(trainable, opt_state, frozen, tokens).compile()
            compile_s = time.perf_counter() - start
            times, state = [], (trainable, opt_state)
            for _ in range(args.steps):
                start = time.perf_counter()
                *state, metrics = compiled(*state, frozen, tokens)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - start)
        say(f"{os.path.basename(path)} ({settings.objective}): kernel {kernel}, "
            f"remat {remat} ({settings.remat_policy()}), precision {precision}: compiled in "
            f"{compile_s:.1f} s; median step {1000 * np.median(times[3:]):.1f} ms, first {1000 * times[0]:.1f} ms; "
            f"loss after {args.steps} steps {float(metrics['loss']):.6f}")


if __name__ == "__main__":
    main()
