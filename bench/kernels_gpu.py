"""GPU benchmark of the linear-attention kernels: Pallas (Triton) against the XLA chunked form,
softmax attention and, where installed, FLA's Triton kernels.

    python bench/kernels.py --gpu                 # the same as python bench/kernels_gpu.py
    python bench/kernels_gpu.py --smoke           # tiny shapes; runs anywhere (interpreted on CPU)

For GDN (Kimi form, per-channel gate) and GLA at B 4, H 16, D 128, T ∈ {1,024, 4,096, 16,384},
in bfloat16 (the dtype GPU training uses), the forward and the forward + backward of:

    linjax pallas        kernels.<mech>.pallas, compiled (forward and backward Pallas kernels)
    linjax chunked       kernels.<mech>.chunked, the pure-JAX form, as XLA compiles it
    softmax cuDNN / XLA  jax.nn.dot_product_attention(is_causal=True), the quadratic baseline
    FLA chunk_kda / chunk_gla   flash-linear-attention's Triton kernels through PyTorch, if importable

Each time is the median of 5 calls after a warm-up call (compilation), synchronised
(block_until_ready, torch.cuda.synchronize). A method that fails is recorded with its error
instead of a time. Writes results/bench/kernels-gpu.json and .md (atomically); refuses to run
without a GPU unless --smoke.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from linjax.files import write_json, write_text
from linjax.kernels import gdn, gla

SIZES = dict(B=4, H=16, D=128, lengths=(1024, 4096, 16384), dtype="bfloat16")
SMOKE = dict(B=1, H=2, D=16, lengths=(64,), dtype="float32")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any backend: checks the script runs")
    p.add_argument("--out", default="results/bench/kernels-gpu.json", help="JSON path (Markdown beside it)")
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args(argv)


def median_seconds(call, sync, repeats):
    sync(call())  # warm-up: compilation, autotuning
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jax_sync(out):
    jax.block_until_ready(out)


def make_inputs(mech, B, T, H, D, dtype, seed=0):
    """q, k, v (L2-normalised q, k, as the mixers feed the kernels), per-channel log α, β."""
    ks = jax.random.split(jax.random.key(seed), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (unit(jax.random.normal(key, (B, T, H, D))).astype(dtype) for key in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, D)).astype(dtype)
    log_alpha = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, D)) + 3.0)
    gates = (log_alpha,) if mech == "gla" else (log_alpha, jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))))
    return (q, k, v) + gates


def with_backward(fn, arity):
    """Forward + backward: the gradient of Σ o with respect to each of the `arity` inputs."""
    def loss(*args):
        out = fn(*args)
        return jnp.sum((out[0] if isinstance(out, tuple) else out).astype(jnp.float32))
    return jax.grad(loss, argnums=tuple(range(arity)))


def jax_methods(mech, interpret):
    module = gla if mech == "gla" else gdn
    pallas = lambda *a: module.pallas(*a, interpret=interpret)
    softmax = lambda impl: lambda q, k, v, *gates: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                  implementation=impl)
    methods = {"linjax pallas": pallas, "linjax chunked": module.chunked, "softmax XLA": softmax("xla")}
    if jax.default_backend() == "gpu":
        methods["softmax cuDNN"] = softmax("cudnn")
    return methods


def fla_method(mech):
    """FLA's Triton kernel as (forward, forward + backward) callables on torch CUDA tensors, or None."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        if mech == "gla":
            from fla.ops.gla import chunk_gla as kernel
        else:
            from fla.ops.kda import chunk_kda as kernel
    except ImportError:
        return None
    return "FLA chunk_gla" if mech == "gla" else "FLA chunk_kda", kernel


def time_fla(kernel, arrays, repeats):
    import numpy as np
    import torch

    tensors = [torch.from_numpy(np.asarray(x, np.float32)).cuda() for x in arrays]
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[str(arrays[0].dtype)]
    q, k, v = (t.to(dtype) for t in tensors[:3])
    gates = tensors[3:]
    sync = lambda _: torch.cuda.synchronize()
    forward = median_seconds(lambda: kernel(q, k, v, *gates), sync, repeats)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, *gates)]
    backward = median_seconds(lambda: kernel(*leaves)[0].float().sum().backward(), sync, repeats)
    return forward, backward


def measure(config, repeats, interpret):
    rows = []
    for mech in ("gdn", "gla"):
        for T in config["lengths"]:
            arrays = make_inputs(mech, config["B"], T, config["H"], config["D"], jnp.dtype(config["dtype"]))
            for name, fn in jax_methods(mech, interpret).items():
                row = dict(mech=mech, method=name, T=T)
                forward, forward_backward = jax.jit(fn), jax.jit(with_backward(fn, len(arrays)))  # compiled once each
                try:
                    row["forward_s"] = median_seconds(lambda: forward(*arrays), jax_sync, repeats)
                    if not name.startswith("softmax"):
                        row["forward_backward_s"] = median_seconds(lambda: forward_backward(*arrays), jax_sync,
                                                                   repeats)
                except Exception as error:  # recorded, not fatal: one method's failure is a result
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.append(row)
                print(row, flush=True)
            fla = fla_method(mech)
            if fla is not None:
                row = dict(mech=mech, method=fla[0], T=T)
                try:
                    row["forward_s"], row["forward_backward_s"] = time_fla(fla[1], arrays, repeats)
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.append(row)
                print(row, flush=True)
    return rows


def markdown(report):
    c = report["config"]
    lines = [f"# Kernels on {report['device']}", "",
             f"B {c['B']}, H {c['H']}, D {c['D']}, {c['dtype']}; seconds, median of {report['repeats']} "
             "(`python bench/kernels_gpu.py`).", "",
             "| mechanism | method | T | forward | forward + backward |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        fmt = lambda key: f"{r[key]:.4f}" if key in r else "—"
        error = f" (failed: {r['error']})" if "error" in r else ""
        lines.append(f"| {r['mech']} | {r['method']}{error} | {r['T']:,} | {fmt('forward_s')} | "
                     f"{fmt('forward_backward_s')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.smoke:
        sys.exit(f"bench/kernels_gpu.py: JAX's backend is {jax.default_backend()!r}, not a GPU; "
                 "install jax[cuda12] on a GPU machine, or pass --smoke to check the script on this one")
    config = SMOKE if args.smoke else SIZES
    rows = measure(config, args.repeats, interpret=not on_gpu)
    report = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__,
                  python=platform.python_version(), config={**config, "lengths": list(config["lengths"])},
                  repeats=args.repeats, rows=rows)
    write_json(args.out, report)
    write_text(os.path.splitext(args.out)[0] + ".md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
