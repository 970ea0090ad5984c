"""In-chunk decays of the gated kernels (GDN, GLA, kGLA), exact at any gate, without e^{−G}.

Inside a chunk of C tokens with per-channel log-gates g_t ≤ 0, write G_i = Σ_{t≤i} g_t. The chunk
forms need three kinds of decay, all e^{(a segment sum of g)} ≤ 1:

    from_start_i = e^{G_i}              what the state entering the chunk keeps at token i
    to_end_j     = e^{G_C − G_j}        what token j's write keeps at the chunk's end
    A_ij         = Σ_d x_id y_jd e^{G_id − G_jd},  j ≤ i   the decayed causal scores (x, y = q or k)

Every exponent is a segment sum Σ_{t∈(a,b]} g_t computed directly, by a 0/1 matrix product, never as
the difference of two cumulative sums, which loses the small exponents next to a −1000 reset. The
[C, C, Dk] decay of A is never built either: A's lower triangle is split recursively into halves,
and the off-diagonal block of each pair of halves factors exactly through the boundary m between
them,
    e^{G_i − G_j} = e^{G_i − G_m} · e^{G_m − G_j},   i > m ≥ j,   both factors ≤ 1,
so each of the log2(C) levels costs one exp per element of x/y plus small matmuls.

    chunk_length(chunk, T)            -> the chunk actually used (a power of two, at most T rounded up)
    chunk_factors(g)                  -> (levels, from_start, to_end), each [..., C, Dg]
    causal_scores(x, y, levels, beta) -> A [..., C, C]  (and, with beta, the delta rule's T⁻¹)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["chunk_length", "segment_matrices", "chunk_factors", "causal_scores"]


def chunk_length(chunk: int, T: int) -> int:
    """`chunk` (a power of two: the halving tree needs one), or the smallest power of two ≥ T
    when the input is shorter than one chunk."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two; got {chunk}")
    return min(chunk, 1 << max(T - 1, 0).bit_length())


def segment_matrices(C: int) -> np.ndarray:
    """0/1 matrices M [L+2, C, C] such that (M[l] @ g)[p] is the exponent at position p:
    for the tree levels (half size h = 1, 2, ..., C/2) the sum between p and its block's
    boundary m, then Σ_{t≤p} (decay from the chunk start) and Σ_{t>p} (decay to the chunk end)."""
    levels = []
    p = np.arange(C)
    t = np.arange(C)
    h = 1
    while h < C:
        m = (p // (2 * h)) * 2 * h + h - 1                      # last position of the lower half
        upper = (p % (2 * h)) >= h
        into = upper[:, None] & (t > m[:, None]) & (t <= p[:, None])      # Σ_{t∈(m,p]}
        out_of = ~upper[:, None] & (t > p[:, None]) & (t <= m[:, None])   # Σ_{t∈(p,m]}
        levels.append(into | out_of)
        h *= 2
    levels.append(t[None, :] <= p[:, None])
    levels.append(t[None, :] > p[:, None])
    return np.stack(levels).astype(np.float32)


def chunk_factors(log_gate):
    """log_gate [..., C, Dg] (fp32, ≤ 0; Dg = 1 broadcasts a scalar gate) -> (levels, from_start,
    to_end): the tree's level factors (a list of log2(C) arrays) and the two chunk-edge decays,
    all [..., C, Dg] and ≤ 1.

    Each segment sum is one [C, C] 0/1 product batched over the leading axes, so the result keeps
    Dg minor, the layout every consumer reads. Measured alternatives were slower on a 2-core CPU
    (GDN forward at T=4096, D=128: 0.18 s this way): one product for all levels, transposed
    (0.23 s; without a barrier XLA:CPU re-reads it strided inside every consumer), and the sums
    built by doubling with additions only (0.22 s, 2× slower backward)."""
    C = log_gate.shape[-2]
    batch = log_gate.shape[:-2]
    factors = [jnp.exp(jnp.broadcast_to(m, (*batch, C, C)) @ log_gate) for m in jnp.asarray(segment_matrices(C))]
    return factors[:-2], factors[-2], factors[-1]


def _merge(prev, cross):
    """Blocks [..., 2n, h, h] (diagonal) and [..., n, h, h] (lower-left) -> [..., n, 2h, 2h]."""
    n, h = cross.shape[-3], cross.shape[-1]
    prev = prev.reshape(*prev.shape[:-3], n, 2, h, h)
    zero = jnp.zeros_like(cross)
    top = jnp.concatenate([prev[..., 0, :, :], zero], axis=-1)
    bottom = jnp.concatenate([cross, prev[..., 1, :, :]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def causal_scores(q, k, levels, beta=None):
    """A = tril(Q Kᵀ ⊙ decay) [..., C, C] (diagonal included, decay 1 there) from the level
    factors of `chunk_factors`: the recursive halving above. q, k [..., C, Dk].

    With `beta` [..., C] (the delta rule), also returns T⁻¹ = (I + Diag(β) tril₋₁(K Kᵀ ⊙ decay))⁻¹,
    built in the same pass by 2×2 block inversion of a unit lower-triangular matrix,
        [[P, 0], [X, R]]⁻¹ = [[P⁻¹, 0], [−R⁻¹ X P⁻¹, R⁻¹]],
    merging the inverses of the two halves with the cross block X of the same level. That is
    forward substitution in blocks, as exact, using matrix products only: no LAPACK call, whose
    XLA:CPU kernel can deadlock the worker pool it shares with other ops (issue 15)."""
    C = q.shape[-2]
    scores = jnp.sum(q * k, axis=-1)[..., None, None]        # [..., C, 1, 1]: decay 1 on the diagonal
    t_inv = None if beta is None else jnp.ones_like(scores)  # 1 × 1 blocks of a unit diagonal
    for level, f in enumerate(levels):
        h = 2 ** level
        split = lambda x: x.reshape(*x.shape[:-2], C // (2 * h), 2, h, x.shape[-1])
        qf, kf = split(q * f), split(k * f)
        lower = kf[..., 0, :, :]                               # e^{G_m − G_j} k_j
        scores = _merge(scores, jnp.einsum("...nid,...njd->...nij", qf[..., 1, :, :], lower))
        if beta is not None:
            cross = split(beta[..., None])[..., 1, :, :] * jnp.einsum("...nid,...njd->...nij",
                                                                      kf[..., 1, :, :], lower)
            halves = t_inv.reshape(*t_inv.shape[:-3], C // (2 * h), 2, h, h)
            first, second = halves[..., 0, :, :], halves[..., 1, :, :]
            t_inv = _merge(t_inv, -(second @ cross @ first))
    scores = scores[..., 0, :, :]
    return scores if beta is None else (scores, t_inv[..., 0, :, :])
