"""CPU benchmark of the linear-attention kernels against their baselines.

    python bench/kernels.py            # full: D ∈ {64, 128}, T ∈ {512 … 16384}
    python bench/kernels.py --quick    # D = 64, T ∈ {512, 1024}
    python bench/kernels.py --targets  # GDN, GLA and SDPA at D = 128, T ∈ {1024, 4096, 16384}
    python bench/kernels.py --gpu      # on a GPU machine: Pallas vs XLA, cuDNN, FLA (bench/kernels_gpu.py)

Times the forward and the forward+backward of GDN (Kimi form, per-channel
gate) and GLA at B = 1, H = 8:

    linjax chunked     kernels.<mech>.chunked, jitted (the training path)
    linjax reference   kernels.<mech>.reference, the fp32 lax.scan spec, jitted
    state recurrence alone, C=32 / C=128 (, outputs after)
                       GDN only: what any chunked form computes besides its in-chunk
                       work (`state_recurrence_alone`), outputs inside the scan over
                       chunks or after it; the fastest is a lower bound for
                       `linjax chunked` on this machine
    FLA naive          fla/ops/kda/naive.py naive_chunk_kda (GDN) and
                       fla/ops/gla/naive.py naive_recurrent_gla (GLA), PyTorch
and causal softmax attention as the quadratic baseline:
    torch SDPA         torch.nn.functional.scaled_dot_product_attention(is_causal=True)
    XLA attention      jax.nn.dot_product_attention(is_causal=True, implementation="xla")

Each time is the median of a few calls after one warm-up call (which
includes compilation), with block_until_ready / torch's synchronous CPU ops.
A method is skipped at a size where one call is predicted (power law fitted
to its two previous sizes) to take over 60 s, or where its memory estimate
exceeds half the available RAM. The Pallas kernels are not timed here: on
CPU they only run in the interpreter.

GFLOP/s use nominal FLOP counts (see `flops`), the same count for every
implementation of one mechanism, next to the fp32 matmul rate measured
with jnp at the start. Prints a Markdown table; writes it and the JSON
(default results/bench/kernels.json and .md beside it), atomically.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import sys
import time

LIMIT_S = 60.0
TORCH_METHODS = {"torch SDPA", "FLA naive_chunk_kda", "FLA naive_recurrent_gla"}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true", help="run the GPU benchmark instead (bench/kernels_gpu.py)")
    p.add_argument("--quick", action="store_true", help="D = 64, T ∈ {512, 1024} only")
    p.add_argument("--targets", action="store_true",
                   help="only what the speed targets need: GDN, GLA and SDPA, D = 128, T ∈ {1024, 4096, 16384}")
    p.add_argument("--out", default="results/bench/kernels.json", help="JSON results path")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads for torch and XLA (default: all cores)")
    return p.parse_args()


if "--gpu" in sys.argv[1:]:  # the GPU benchmark is its own script; forward to it before torch is imported
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kernels_gpu

    kernels_gpu.main([a for a in sys.argv[1:] if a != "--gpu"])
    sys.exit()
from linjax.app.hugepages import reexec_with_huge_pages  # noqa: E402

if __name__ == "__main__":  # measured with huge pages for XLA's buffers, as the `linjax` command runs
    reexec_with_huge_pages([os.path.abspath(__file__), *sys.argv[1:]])
ARGS = parse_args()
# XLA's CPU client sizes its thread pool from the visible cores; restrict both
# frameworks to the same cores so the comparison is fair.
if ARGS.threads < os.cpu_count() and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, set(range(ARGS.threads)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from linjax.files import write_json, write_text  # noqa: E402
from linjax.kernels import decay, gdn, gla  # noqa: E402

torch.set_num_threads(ARGS.threads)


def fla_naive(sub: str):
    """fla/ops/<sub>/naive.py loaded by path (`import fla` needs triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", sub, "naive.py")
    module_spec = importlib.util.spec_from_file_location(f"fla_naive_{sub}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ measuring


def median_time(call, block):
    """Warm-up call (compile), then the median of 3 timed calls; 1 call if the
    warm-up took over 5 s, none over 20 s (then the warm-up is the time:
    compilation is small beside it)."""
    t0 = time.perf_counter()
    block(call())
    first = time.perf_counter() - t0
    if first > 20:
        return first
    times = []
    for _ in range(3 if first < 5 else 1):
        t0 = time.perf_counter()
        block(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def jax_block(x):
    jax.block_until_ready(x)


def torch_block(x):
    return x  # CPU torch ops are synchronous


def matmul_gflops(n=2048):
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda a: a @ a)
    return 2 * n ** 3 / median_time(lambda: f(a), jax_block) / 1e9


def flops(mech, T, D, H=8):
    """Nominal forward FLOPs (B = 1). Chunked linear attention with chunk C per
    token and head: q·S and the state update 4·D², intra-chunk QKᵀ and A·V
    2·C·2D; GDN adds K·Kᵀ (2·C·D), (K⊙Γ)·S (2·D²) and the triangular solve
    (C·D). Causal softmax: 2·T²·D per head. Backward counted as 2× forward. C is the
    chunk each kernel uses by default (gdn.CHUNK, gla.CHUNK)."""
    C = gdn.CHUNK if mech == "gdn" else gla.CHUNK
    per_token = {"gla": 4 * D * D + 4 * C * D,
                 "gdn": 6 * D * D + 6 * C * D + C * D}
    if mech == "softmax":
        return 2.0 * T * T * D * H
    return float(per_token[mech]) * T * H


# ------------------------------------------------------------------ methods


def inputs(mech, T, D, H=8, seed=0):
    """numpy fp32 inputs (numpy, so that preparing torch inputs runs no XLA):
    L2-normalised q, k; log α = log σ(z + 4) per channel; β = σ(z)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = unit(normal(1, T, H, D)), unit(normal(1, T, H, D)), normal(1, T, H, D)
    log_alpha = -np.logaddexp(0.0, -(normal(1, T, H, D) + 4.0)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-normal(1, T, H)))).astype(np.float32)
    return {"gdn": (q, k, v, log_alpha, beta), "gla": (q, k, v, log_alpha)}.get(mech, (q, k, v))


def jax_method(fn, args):
    """(forward call, forward+backward call) of a jax function returning o first."""
    args = tuple(jnp.asarray(a) for a in args)
    fwd = jax.jit(lambda *a: _first(fn(*a)))
    do = jax.random.normal(jax.random.PRNGKey(1), args[2].shape)
    loss = lambda *a: jnp.sum(_first(fn(*a)) * do)
    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    return (lambda: fwd(*args)), (lambda: grad(*args)), jax_block


def state_recurrence_alone(q, k, v, log_alpha, beta, chunk, outputs_after=False):
    """What every chunk-parallel delta rule must compute besides its in-chunk work: per chunk of C
    tokens and head, U = Ũ − W S, the state update S ← Diag(Γ_C) S + (K ⊙ e^{G_C − G})ᵀ U and the
    outputs (Q⊙Γ) S + A U (kernels/gdn.py). k, v and a fixed [C, C] matrix stand in for W, Ũ and
    A, which a real kernel must also compute (the decay tree, T⁻¹): this times the floor under it,
    not a usable kernel. The scan over chunks is inherently sequential; `outputs_after` moves the
    outputs out of it (the states entering each chunk stacked, then one batched product for all
    chunks), leaving two [C, D]-by-[D, D]-sized products per step, as `gdn.chunked`'s scan has three."""
    B, T, H, D = q.shape
    xs = tuple(decay.to_chunks(x, chunk) for x in (q, k, v, log_alpha))
    scores = jnp.tril(jnp.ones((chunk, chunk), jnp.float32)) / chunk

    def update(S, k, u, la):
        return jnp.exp(la[..., -1, :])[..., None] * S + jnp.swapaxes(k, -1, -2) @ u

    def step(S, x):
        q, k, v, la = map(decay.swap_tokens_and_heads, x)   # one chunk's heads first, as gdn.chunked does
        if outputs_after:
            u = v - k @ S
            return update(S, k, u, la), (S, u)
        read = jnp.concatenate([k, q], axis=-2) @ S
        u = v - read[..., :chunk, :]
        return update(S, k, u, la), decay.swap_tokens_and_heads(read[..., chunk:, :] + scores @ u)

    S, out = jax.lax.scan(step, jnp.zeros((B, H, D, v.shape[-1]), jnp.float32), xs)
    if outputs_after:
        entering, u = out                                   # [N, B, H, ...]
        out = jnp.swapaxes(jnp.swapaxes(xs[0], 2, 3) @ entering + scores @ u, 2, 3)
    return decay.from_chunks(out, T), S


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def torch_method(fn, args):
    """(forward call, forward+backward call) of a torch function returning o first."""
    leaves = [torch.from_numpy(a) for a in args]
    do = torch.randn_like(leaves[2])

    def forward():
        with torch.no_grad():
            return _first(fn(*leaves))

    def forward_backward():
        inputs = [x.detach().requires_grad_(True) for x in leaves]
        (_first(fn(*inputs)) * do).sum().backward()
        return inputs[0].grad

    return forward, forward_backward, torch_block


def methods(mech, D):
    """name → (builder(args) -> (fwd, fwd+bwd, block), memory estimate(T, backward) in bytes)."""
    H = 8
    none = lambda T, backward: 0.0
    # [H, D, D] fp32 states saved per token for the backward
    state_per_step = lambda T, backward: 2 * 4.0 * T * H * D * D if backward else 0.0
    # [H, T, T] fp32 scores and probabilities (and their gradients)
    scores = lambda T, backward: (3 if backward else 2) * 4.0 * H * T * T
    if mech == "softmax":
        attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="xla")
        sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        return {"torch SDPA": (lambda a: torch_method(sdpa, a), none),
                "XLA attention": (lambda a: jax_method(attn, a), scores)}
    module = gdn if mech == "gdn" else gla
    table = {"linjax chunked": (lambda a: jax_method(module.chunked, a), none),
             "linjax reference": (lambda a: jax_method(module.reference, a), state_per_step)}
    if mech == "gdn":
        for C in (gdn.CHUNK, 128):
            for after in (False, True):
                table[f"state recurrence alone, C={C}" + (", outputs after" if after else "")] = (
                    lambda a, C=C, after=after: jax_method(
                        lambda *x: state_recurrence_alone(*x, chunk=C, outputs_after=after), a), none)
    if mech == "gdn" and (kda := fla_naive("kda")) is not None:
        table["FLA naive_chunk_kda"] = (
            lambda a: torch_method(lambda q, k, v, g, b: kda.naive_chunk_kda(q, k, v, g, b), a),
            # its 64-step Python loops keep [T, H, D] fp32 temporaries per step for autograd
            lambda T, backward: (3 * 64 if backward else 2) * 4.0 * T * H * D)
    if mech == "gla" and (naive_gla := fla_naive("gla")) is not None:
        table["FLA naive_recurrent_gla"] = (
            lambda a: torch_method(naive_gla.naive_recurrent_gla, a), state_per_step)
    return table


def available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable"):
                return int(line.split()[1]) * 1024
    return float("inf")


def predicted(history, T):
    """Time at T from a power law through the last two (T, seconds) points (one point: linear)."""
    if not history:
        return 0.0
    if len(history) == 1:
        (T1, t1), = history
        return t1 * T / T1
    (T1, t1), (T2, t2) = history[-2:]
    p = min(max(math.log(max(t2, 1e-9) / max(t1, 1e-9)) / math.log(T2 / T1), 1.0), 3.0)
    return t2 * (T / T2) ** p


# ------------------------------------------------------------------ main


def main():
    Ds = [64] if ARGS.quick else [128] if ARGS.targets else [64, 128]
    Ts = ([512, 1024] if ARGS.quick else [1024, 4096, 16384] if ARGS.targets
          else [512, 1024, 2048, 4096, 8192, 16384])
    mechs = ["gdn", "gla", "softmax"]
    peak = matmul_gflops()
    machine = {"cpu_count": os.cpu_count(), "threads": ARGS.threads,
               "processor": platform.processor() or platform.machine(),
               "jax": jax.__version__, "torch": torch.__version__,
               "fp32_matmul_gflops": round(peak, 1),
               "thread_note": f"torch.set_num_threads({ARGS.threads}); XLA CPU uses its default "
                              f"pool over the same {ARGS.threads} visible cores"}
    print(f"fp32 matmul (jnp, 2048²): {peak:.1f} GFLOP/s; threads: {ARGS.threads}", file=sys.stderr)
    # All JAX methods first, then the PyTorch ones: going back to XLA after
    # torch's OpenMP pool has run once left a block_until_ready hanging here.
    plan = [(mech, D, name, build, memory)
            for mech in mechs for D in Ds
            for name, (build, memory) in methods(mech, D).items()
            if not (ARGS.targets and name in ("XLA attention", "FLA naive_recurrent_gla"))]
    plan.sort(key=lambda p: p[2] in TORCH_METHODS)
    rows = []
    for mech, D, name, build, memory in plan:
        history = {"fwd": [], "fwd+bwd": []}
        for T in Ts:
            rows.append(measure_row(mech, D, name, build, memory, T, history))
            save({"machine": machine, "rows": rows})  # partial results survive a crash
    order = lambda r: (["gdn", "gla", "softmax"].index(r["mechanism"]), r["D"], r["impl"], r["T"])
    rows.sort(key=order)
    report = {"machine": machine, "rows": rows, "targets": targets(rows)}
    save(report)
    print(markdown(report))
    print(f"\nwrote {ARGS.out}", file=sys.stderr)


def measure_row(mech, D, name, build, memory, T, history):
    fwd, fwd_bwd, block = build(inputs(mech, T, D))
    row = {"mechanism": mech, "impl": name, "D": D, "T": T}
    for mode, call in [("fwd", fwd), ("fwd+bwd", fwd_bwd)]:
        if predicted(history[mode], T) > LIMIT_S:
            row[mode] = "skipped (>60 s)"
        elif memory(T, mode == "fwd+bwd") > available_bytes() / 2:
            row[mode] = "skipped (memory)"
        else:
            seconds = median_time(call, block)
            history[mode].append((T, seconds))
            work = flops(mech, T, D) * (3 if mode == "fwd+bwd" else 1)
            row[mode] = round(seconds, 5)
            row[mode + " GFLOP/s"] = round(work / seconds / 1e9, 2)
    print(f"{mech:7s} {name:24s} D={D:<4d} T={T:<6d} fwd={row['fwd']} "
          f"fwd+bwd={row['fwd+bwd']}", file=sys.stderr, flush=True)
    return row


def save(report):
    write_json(ARGS.out, report)
    if "targets" in report:
        write_text(os.path.splitext(ARGS.out)[0] + ".md", markdown(report) + "\n")


def lookup(rows, mech, impl, D, T, mode):
    for r in rows:
        if (r["mechanism"], r["impl"], r["D"], r["T"]) == (mech, impl, D, T):
            value = r.get(mode)
            return value if isinstance(value, float) else None
    return None


def targets(rows):
    """The issue's speed targets for chunked GDN (D = 128 where measured, else 64)."""
    D = 128 if lookup(rows, "gdn", "linjax chunked", 128, 1024, "fwd") else 64
    g = lambda impl, T, mode="fwd", mech="gdn": lookup(rows, mech, impl, D, T, mode)
    ratio = lambda a, b: None if a is None or b is None else round(a / b, 2)
    out = {
        f"chunked GDN fwd at T=4096, D={D} (s; about 0.1)": g("linjax chunked", 4096),
        "FLA naive_chunk_kda / chunked, fwd at T=4096 (≥ 20)":
            ratio(g("FLA naive_chunk_kda", 4096), g("linjax chunked", 4096)),
        "SDPA / chunked GDN, fwd at T=4096 (≥ 2.5)":
            ratio(g("torch SDPA", 4096, mech="softmax"), g("linjax chunked", 4096)),
        "SDPA / chunked GDN, fwd at T=16384 (≥ 10)":
            ratio(g("torch SDPA", 16384, mech="softmax"), g("linjax chunked", 16384)),
        "scan reference / chunked GDN, fwd+bwd at T=4096 (≥ 5)":
            ratio(g("linjax reference", 4096, "fwd+bwd"), g("linjax chunked", 4096, "fwd+bwd")),
        "chunked GDN fwd time(16384) / time(1024) (≤ 20)":
            ratio(g("linjax chunked", 16384), g("linjax chunked", 1024)),
        "chunked GDN / chunked GLA, fwd at T=4096 (≥ 1: GLA at least as fast)":
            ratio(g("linjax chunked", 4096), g("linjax chunked", 4096, mech="gla")),
        "chunked GDN / chunked GLA, fwd+bwd at T=4096 (≥ 1)":
            ratio(g("linjax chunked", 4096, "fwd+bwd"), g("linjax chunked", 4096, "fwd+bwd", mech="gla")),
    }
    # The floor: the state work alone, at the kernel's chunk and a long one, outputs inside the scan
    # or after it; the fastest of the four. A ratio below a target here means no chunked form of
    # this shape reaches that target on this machine.
    for T in (4096, 16384):
        times = [r["fwd"] for r in rows if r["impl"].startswith("state recurrence alone") and r["D"] == D
                 and r["T"] == T and isinstance(r["fwd"], float)]
        floor = min(times) if times else None
        out[f"state recurrence alone, fastest, fwd at T={T} (s; lower bound for chunked GDN)"] = floor
        out[f"SDPA / state recurrence alone, fwd at T={T} (best reachable; target {2.5 if T == 4096 else 10})"] = \
            ratio(g("torch SDPA", T, mech="softmax"), floor)
        if T == 4096:
            out["FLA naive_chunk_kda / state recurrence alone, fwd at T=4096 (best reachable; target 20)"] = \
                ratio(g("FLA naive_chunk_kda", T), floor)
    return out


def markdown(report):
    m = report["machine"]
    lines = [f"CPU: {m['cpu_count']} cores ({m['processor']}), threads {m['threads']} for torch and "
             f"XLA; measured fp32 matmul {m['fp32_matmul_gflops']} GFLOP/s; jax {m['jax']}, "
             f"torch {m['torch']}. B = 1, H = 8, fp32.", "",
             "| mechanism | implementation | D | T | fwd (s) | fwd GFLOP/s | fwd+bwd (s) | fwd+bwd GFLOP/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['mechanism']} | {r['impl']} | {r['D']} | {r['T']} | {r['fwd']} | "
                     f"{r.get('fwd GFLOP/s', '')} | {r['fwd+bwd']} | {r.get('fwd+bwd GFLOP/s', '')} |")
    lines += ["", "| target | measured |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["targets"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
