"""The delta rule's T⁻¹: the inverse of a unit lower-triangular [C, C] matrix given by blocks,
with a closed-form backward.

`decay.causal_scores` builds T = I + Diag(β) tril₋₁(K Kᵀ ⊙ decay) level by level of its halving
tree: at the level of half size h, each 2h × 2h diagonal block of T is [[P, 0], [X, Q]], where X
(h × h, "the cross block") is new and P, Q are the blocks of the level below. Every strictly-lower
entry of T lies in exactly one cross block, so the cross blocks of all levels are T.

Forward: forward substitution in blocks, [[P, 0], [X, Q]]⁻¹ = [[P⁻¹, 0], [−Q⁻¹ X P⁻¹, Q⁻¹]], level by
level, matrix products only (no LAPACK call: XLA:CPU's LAPACK kernels can deadlock, tests/kernels/test_no_lapack.py).

Backward: with R = T⁻¹, dR = −R dT R, so the gradient of T is −Rᵀ (∂L/∂R) Rᵀ, two [C, C] products,
cut back into the cross blocks. Autodiff through the forward instead transposes every level's
merges and products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["unit_lower_inverse", "merge_blocks"]


def merge_blocks(prev, cross):
    """Blocks [..., 2n, h, h] (diagonal) and [..., n, h, h] (lower-left) -> [..., n, 2h, 2h]: one
    level of the halving tree (also how `decay.causal_scores` assembles the decayed scores)."""
    n, h = cross.shape[-3], cross.shape[-1]
    prev = prev.reshape(*prev.shape[:-3], n, 2, h, h)
    zero = jnp.zeros_like(cross)
    top = jnp.concatenate([prev[..., 0, :, :], zero], axis=-1)
    bottom = jnp.concatenate([cross, prev[..., 1, :, :]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _inverse(crosses):
    inverse = jnp.ones((*crosses[0].shape[:-3], 2 * crosses[0].shape[-3], 1, 1), crosses[0].dtype)
    for cross in crosses:
        n, h = cross.shape[-3], cross.shape[-1]
        halves = inverse.reshape(*inverse.shape[:-3], n, 2, h, h)
        first, second = halves[..., 0, :, :], halves[..., 1, :, :]
        inverse = merge_blocks(inverse, -(second @ cross @ first))
    return inverse[..., 0, :, :]


@jax.custom_vjp
def unit_lower_inverse(crosses):
    """crosses: a list over the levels h = 1, 2, ..., C/2 of T's cross blocks, level h shaped
    [..., C/(2h), h, h] (block n is rows 2hn + h .. 2hn + 2h − 1, columns 2hn .. 2hn + h − 1 of T).
    Returns T⁻¹ [..., C, C], unit lower-triangular."""
    return _inverse(crosses)


def _forward(crosses):
    inverse = _inverse(crosses)
    return inverse, inverse


def _backward(inverse, d_inverse):
    inverse_t = jnp.swapaxes(inverse, -1, -2)
    d_matrix = -(inverse_t @ d_inverse @ inverse_t)                 # ∂L/∂T, T's full [C, C]
    blocks = d_matrix[..., None, :, :]                              # the top level's one 2h block
    grads = []
    while blocks.shape[-1] > 1:
        h = blocks.shape[-1] // 2
        grads.append(blocks[..., h:, :h])
        halves = jnp.stack([blocks[..., :h, :h], blocks[..., h:, h:]], axis=-3)
        blocks = halves.reshape(*halves.shape[:-4], 2 * halves.shape[-4], h, h)
    return (grads[::-1],)


unit_lower_inverse.defvjp(_forward, _backward)
