"""Training speed on smollm2-135m, linjax side by side with PyTorch, in one run on this machine.

    python bench/train.py [--seq-lens 512,1024,4096] [--repeats 3] [--out results/bench/train.json]

Rows, batch 1, fp32, each the median of `--repeats` timed calls after one compiling call and
one warm-up call:
- "forward + loss": next-token cross-entropy of the pretrained model (no gradient);
- "floor": the loss and its gradient with respect to the input embeddings, every weight
  frozen. Any training step of new parameters inside the model pays at least this;
- the training step (`make_train_step`, as `linjax train` runs it: loss, gradient of the
  trainable parameters, clipping, AdamW) of the paper's final recipe (GDN + window 56 +
  sinks 8 + short conv), of GDN + w56 + s8 without the convolution, of pure GDN and pure GLA,
  of the final recipe with the layer-wise attention-transfer objective, and with 64 retained
  tokens chosen 8 at a time (docs/retention.md).
PyTorch: transformers' LlamaForCausalLM from the same GGUF file, SDPA attention, with as many
threads as JAX uses cores. Prints a Markdown table and writes JSON (rewritten after every
row, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

# Run as a script, bench/ is sys.path[0], and bench/kernels.py would shadow the PyPI `kernels`
# package that transformers probes for at import. The benchmarks import only installed packages.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

from linjax.app.hugepages import reexec_with_huge_pages

if __name__ == "__main__":  # both frameworks measured with huge pages, as the `linjax` command runs
    reexec_with_huge_pages([os.path.abspath(__file__), *sys.argv[1:]])

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import linjax
from linjax.experiment import TrainSection
from linjax.files import write_json
from linjax.scan import layer_runs, run_layers, stack_layers, unstack_layers
from linjax.train import sharding
from linjax.train.cross_entropy import cross_entropy
from linjax.train.loop import make_optimizer, make_train_step, place_train_state
from linjax.train.objectives import next_token_loss

FINAL_RECIPE = linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8, adapter="shortconv")
# name -> (linearization, training objective)
STEPS = {
    "gdn+w56+s8+shortconv": (FINAL_RECIPE, "ce"),
    "gdn+w56+s8": (linjax.LinearizeConfig(mechanism="gdn", window=56, sinks=8), "ce"),
    "gdn (pure)": (linjax.LinearizeConfig(mechanism="gdn", window=0, sinks=0), "ce"),
    "gla (pure)": (linjax.LinearizeConfig(mechanism="gla", window=0, sinks=0), "ce"),
    "gdn+w56+s8+shortconv, attention transfer": (FINAL_RECIPE, "attention_transfer"),
    # the trained retention row: 64 retained tokens chosen 8 at a time (configs/claims/...-retain64.toml)
    "gdn+w56+s8+shortconv, 64 retained in blocks of 8": (dataclasses.replace(FINAL_RECIPE, retain=64, retain_block=8),
                                                         "ce"),
}


def timed(call, repeats):
    """(first call in s, median of `repeats` calls after one warm-up) for a blocking call."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def torch_calls(seq_len):
    """PyTorch's forward + loss and floor for one random batch of `seq_len` tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from linjax.convert.sources import embedded_gguf_path

    torch.set_num_threads(os.cpu_count())
    path = embedded_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="sdpa").eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokens = torch.from_numpy(batch_tokens(seq_len).astype(np.int64))

    def forward():
        with torch.no_grad():
            model(input_ids=tokens, labels=tokens).loss.item()

    def floor():
        embeds = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
        model(inputs_embeds=embeds, labels=tokens).loss.backward()
        embeds.grad.sum().item()

    return {"forward + loss": forward, "floor": floor}


def linjax_calls(base, seq_len):
    """linjax's forward + loss and floor, jitted, weights passed as arguments stacked by layer run
    (as the training step holds them, `linjax.train.loop.place_train_state`)."""
    graphdef, params = nnx.split(base)
    params = stack_layers(params, layer_runs(base.layers))
    tokens = jnp.asarray(batch_tokens(seq_len))

    def loss_from_embeddings(embeddings, params, tokens):
        model = nnx.merge(graphdef, unstack_layers(params))
        positions = jnp.arange(tokens.shape[1] - 1, dtype=jnp.int32)[None]
        x, _ = run_layers(model.layers, embeddings, positions, remat=model.remat)
        logits = model.logits(model.norm(x)).astype(jnp.float32)
        return jnp.mean(cross_entropy(logits, tokens[:, 1:]))

    forward = jax.jit(lambda params, tokens: next_token_loss(nnx.merge(graphdef, unstack_layers(params)), tokens))
    floor = jax.jit(lambda params, tokens: jax.grad(loss_from_embeddings)(
        nnx.merge(graphdef, unstack_layers(params)).embed_tokens(tokens[:, :-1]), params, tokens))
    return {"forward + loss": lambda: jax.block_until_ready(forward(params, tokens)),
            "floor": lambda: jax.block_until_ready(floor(params, tokens))}


def train_step_call(base, config, seq_len, mesh, objective="ce"):
    """One `linjax train` step of `config`, state placed exactly as the training loop places it."""
    model = linjax.linearize(base, config, seed=1)
    optimizer, _ = make_optimizer(TrainSection(steps=100, seq_len=seq_len, warmup_steps=10), config.adapter)
    graphdef, trainable, opt_state, frozen, _ = place_train_state(model, optimizer, mesh)
    step = make_train_step(graphdef, optimizer, objective, mesh)
    state = [trainable, opt_state]
    batch = sharding.put_batch(batch_tokens(seq_len), mesh)

    def call():
        *new_state, metrics = step(*state, frozen, batch)
        jax.block_until_ready(metrics)
        state[:] = new_state

    return call


def cpu_model() -> str:
    """The CPU's model name and whether it has AVX-512: hosts of one shared machine differ, and
    XLA:CPU and PyTorch gain differently from AVX-512, so ratios compare only within one host."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            info = cpuinfo.read()
    except OSError:
        return platform.processor()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return f"{name}{', AVX-512' if ' avx512f' in info else ''}"


def batch_tokens(seq_len):
    return np.random.default_rng(0).integers(0, 49152, (1, seq_len), dtype=np.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="512,1024,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="results/bench/train.json")
    parser.add_argument("--no-train-steps", action="store_true",
                        help="only the forward and floor rows of both frameworks (a few minutes)")
    args = parser.parse_args()
    base, _ = linjax.load("smollm2-135m")
    mesh = sharding.make_mesh()
    import torch

    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
               "cpu_model": cpu_model(),
               "jax": jax.__version__, "torch": torch.__version__, "backend": jax.default_backend(),
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}
    rows = []

    def record(framework, what, seq_len, call):
        first, median = timed(call, args.repeats)
        rows.append({"framework": framework, "what": what, "seq_len": seq_len, "seconds": median,
                     "tokens_per_s": seq_len / median, "first_call_s": first, "repeats": args.repeats})
        print(f"{framework:8s} {what:32s} T={seq_len}: {median:.2f} s (first {first:.1f} s)", flush=True)
        write_json(args.out, {"machine": machine, "rows": rows})

    # Short sequences first: a long one that runs out of memory leaves the rows measured before it.
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for what, call in torch_calls(seq_len).items():
            record("PyTorch", what, seq_len, call)
        for what, call in linjax_calls(base, seq_len).items():
            record("linjax", what, seq_len, call)
        for name, (config, objective) in ({} if args.no_train_steps else STEPS).items():
            record("linjax", f"train step: {name}", seq_len, train_step_call(base, config, seq_len, mesh, objective))
    print(markdown(rows))
    print(f"wrote {args.out}")


def markdown(rows) -> str:
    """One row per measurement, one column per sequence length (seconds; first call in brackets)."""
    lengths = sorted({r["seq_len"] for r in rows})
    names = list(dict.fromkeys((r["framework"], r["what"]) for r in rows))
    by_key = {(r["framework"], r["what"], r["seq_len"]): r for r in rows}
    lines = ["| | " + " | ".join(f"T {n:,}: s (first call)" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for framework, what in names:
        cells = [f"{r['seconds']:.2f} ({r['first_call_s']:.1f})" if (r := by_key.get((framework, what, n))) else "–"
                 for n in lengths]
        lines.append(f"| {framework} {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
