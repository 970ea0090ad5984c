"""Correctness rows of the sink + window Pallas kernel (swa_pallas.py) against the dense
`swa.reference`, for a GPU check (`check_rows()`, compiled) and the CPU tests (interpreted).

Each row runs swa.pallas and swa.reference on the same fresh random q, k, v (T not a multiple of
the block, GQA), with the kernels' outputs starting as NaN, and compares the three SoftmaxParts
and the gradients in q, k, v under random cotangents on all three parts (so the log-sum-exp's and
the row max's gradient paths are checked, not only the normalised output's) by relative RMS.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from linjax.kernels import swa, swa_pallas

# Relative RMS allowed, (outputs, input gradients). bf16: the kernel rounds P and dS to bf16 before
# their dots (measured ~1.3e-3 / ~3.2e-3 at T 250, D 32 against the fp32 reference on the same
# bf16 inputs); fp32: IEEE fp32 dots (measured ≤ 5e-7).
TOLERANCE = {"float32": (1e-5, 1e-4), "bfloat16": (5e-3, 1e-2)}

# (sinks, window, kv heads) per row, each in fp32 and bf16: the paper's budgets (8 + 56, 0 + 64),
# a window over two blocks, sinks beyond one block with a tiny window.
CASES = [(8, 56, 2), (0, 64, 4), (8, 128, 1), (70, 5, 2)]


def relative_rms(actual, expected) -> float:
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    denom = np.linalg.norm(e)
    return float(np.linalg.norm(a - e) / denom) if denom > 0 else float(np.linalg.norm(a))


def random_inputs(seed, *, B, T, H, kv_heads, D, dtype):
    """q [B,T,H,D], k, v [B,T,kv_heads,D] (dtype) and fp32 cotangents for the three SoftmaxParts."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
    q = normal(ks[0], (B, T, H, D)).astype(dtype)
    k = normal(ks[1], (B, T, kv_heads, D)).astype(dtype)
    v = normal(ks[2], (B, T, kv_heads, D)).astype(dtype)
    cotangents = swa.SoftmaxParts(normal(ks[3], (B, T, H, D)), normal(ks[4], (B, T, H)), normal(ks[5], (B, T, H)))
    return q, k, v, cotangents


def _outputs_and_grads(attention):
    def run(q, k, v, cotangents):
        parts, vjp = jax.vjp(attention, q, k, v)
        return parts, vjp(cotangents)

    return jax.jit(run)


def compare(q, k, v, cotangents, *, sinks, window, interpret):
    """{"numerator", "row_max", "row_sum", "dq", "dk", "dv"} -> relative RMS of the kernel (outputs
    poisoned) against swa.reference, and "finite": whether every kernel result is finite."""
    kernel = _outputs_and_grads(lambda q, k, v: swa.SoftmaxParts(*swa_pallas.softmax_parts(
        q, k, v, sinks=sinks, window=window, interpret=interpret, poison=True)))
    spec = _outputs_and_grads(lambda q, k, v: swa.reference(q, k, v, sinks=sinks, window=window))
    (parts, grads), (ref_parts, ref_grads) = kernel(q, k, v, cotangents), spec(q, k, v, cotangents)
    errors = {name: relative_rms(a, e) for name, a, e in zip(("numerator", "row_max", "row_sum"), parts, ref_parts)}
    errors |= {name: relative_rms(a, e) for name, a, e in zip(("dq", "dk", "dv"), grads, ref_grads)}
    errors["finite"] = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (*parts, *grads))
    return errors


def check_rows(*, B=2, T=1000, H=4, D=128, interpret=False, seed=0, cases=CASES, dtypes=("float32", "bfloat16")):
    """One row per (case, dtype): shapes, the errors of `compare`, the tolerance, "ok" and seconds.
    On one GPU: `check_rows()`; a CPU smoke run: `check_rows(B=1, T=130, D=16, interpret=True)`."""
    rows = []
    for n, (sinks, window, kv_heads) in enumerate(cases):
        for dtype in dtypes:
            start = time.perf_counter()
            q, k, v, cotangents = random_inputs(seed + n, B=B, T=T, H=H, kv_heads=kv_heads, D=D, dtype=dtype)
            errors = compare(q, k, v, cotangents, sinks=sinks, window=window, interpret=interpret)
            out_tol, grad_tol = TOLERANCE[dtype]
            ok = errors.pop("finite") and all(
                err <= (grad_tol if name.startswith("d") else out_tol) for name, err in errors.items())
            rows.append(dict(kernel="swa_pallas", dtype=dtype, B=B, T=T, H=H, kv_heads=kv_heads, D=D, sinks=sinks,
                             window=window, **errors, tolerance=[out_tol, grad_tol], ok=bool(ok),
                             seconds=round(time.perf_counter() - start, 2)))
    return rows
