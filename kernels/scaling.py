"""Per-row and per-column scalings, and sums over the last axis, whose gradients are matrix-vector
products instead of reductions.

XLA:CPU runs each small reduction (a [9, 64, 64] block summed over its last axis, say) as a
separate fusion with a fixed cost far above that of a matrix-vector product of the same block.
The chunked kernels' scan steps (`gdn.py`, `gla.py`) and the layers' normalisations use these
instead: the scores' diagonal in the forward; in the backward, the gradients of the state's
chunk decay Diag(Γ_C) S and of T⁻¹ Diag(β). Measurements: results/bench/HISTORY.md.

    row_sums(x)        Σ over the last axis:  x @ 1
    column_sums(x)     Σ over the rows:       1 @ x
    scale_rows(s, x)   s[..., None] * x       (s [..., R] or [..., 1], x [..., R, K])
    scale_cols(x, s)   x * s[..., None, :]    (x [..., R, K], s [..., K])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["row_sums", "column_sums", "scale_rows", "scale_cols"]


# Full fp32 for these products on every backend: a GPU would otherwise round fp32 operands to TF32
# in a matmul, which a reduction never did (RMSNorm's statistics go through `row_sums`).
_EXACT = jax.lax.Precision.HIGHEST


def row_sums(x):
    """Σ over the last axis, as a product with a vector of ones."""
    return jnp.matmul(x, jnp.ones((x.shape[-1],), x.dtype), precision=_EXACT)


def column_sums(x):
    """Σ over the second-to-last axis, as a product with a vector of ones: [..., R, K] -> [..., K]."""
    return jnp.matmul(jnp.ones((x.shape[-2],), x.dtype), x, precision=_EXACT)


@jax.custom_vjp
def scale_rows(s, x):
    """s[..., None] * x: row r of x times s[r]. s [..., R] or [..., 1] (one factor for all rows),
    x [..., R, K]."""
    return s[..., None] * x


def _scale_rows_forward(s, x):
    return s[..., None] * x, (s, x)


def _scale_rows_backward(saved, grad):
    s, x = saved
    d_s = row_sums(grad * x)
    if s.shape[-1] != d_s.shape[-1]:                   # one factor broadcast over the rows
        d_s = row_sums(d_s)[..., None]
    return d_s, s[..., None] * grad


scale_rows.defvjp(_scale_rows_forward, _scale_rows_backward)


@jax.custom_vjp
def scale_cols(x, s):
    """x * s[..., None, :]: column c of x times s[c]. x [..., R, K], s [..., K]."""
    return x * s[..., None, :]


def _scale_cols_forward(x, s):
    return x * s[..., None, :], (x, s)


def _scale_cols_backward(saved, grad):
    x, s = saved
    return grad * s[..., None, :], column_sums(grad * x)


scale_cols.defvjp(_scale_cols_forward, _scale_cols_backward)
