"""In-chunk decays of the gated kernels (GDN, GLA, kGLA), exact at any gate, without e^{−G}.

Inside a chunk of C tokens with per-channel log-gates g_t ≤ 0, write G_i = Σ_{t≤i} g_t. The chunk
forms need three kinds of decay, all e^{(a segment sum of g)} ≤ 1:

    from_start_i = e^{G_i}              what the state entering the chunk keeps at token i
    to_end_j     = e^{G_C − G_j}        what token j's write keeps at the chunk's end
    A_ij         = Σ_d x_id y_jd e^{G_id − G_jd},  j ≤ i   the decayed causal scores (x, y = q or k)

Every decay is e^{g_t} multiplied over its segment (a, b], never e^{G_b − G_a} from the difference of
two cumulative sums, which loses the small exponents next to a −1000 reset. The
[C, C, Dk] decay of A is never built either: A's lower triangle is split recursively into halves,
and the off-diagonal block of each pair of halves factors exactly through the boundary m between
them,
    e^{G_i − G_j} = e^{G_i − G_m} · e^{G_m − G_j},   i > m ≥ j,   both factors ≤ 1,
so each of the log2(C) levels costs a few products per element of x/y plus small matmuls.

    chunk_length(chunk, T)            -> the chunk actually used (a power of two, at most T rounded up)
    to_chunks(x, C), from_chunks(o, T) -> [B,T,H,...] <-> [N,B,C,H,...], the chunk scan's layout
    swap_tokens_and_heads(x)          -> one chunk [B,C,H,...] <-> [B,H,C,...], inside the scan
    chunk_factors(g)                  -> (levels, from_start, to_end), each [..., C, Dg]
    causal_scores(x, y, levels, beta) -> A [..., C, C]  (and, with beta, the delta rule's T⁻¹)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from linjax.kernels import scaling, triangular

__all__ = ["chunk_length", "to_chunks", "swap_tokens_and_heads", "from_chunks", "segment_matrices", "chunk_factors",
           "causal_scores"]


def chunk_length(chunk: int, T: int) -> int:
    """`chunk` (a power of two: the halving tree needs one), or the smallest power of two ≥ T
    when the input is shorter than one chunk."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two; got {chunk}")
    return min(chunk, 1 << max(T - 1, 0).bit_length())


def to_chunks(x, C: int):
    """[B, T, H, ...] -> [N, B, C, H, ...], zero-padded to N whole chunks: one chunk per step of a
    scan. The heads stay after the tokens, so for B = 1 this is a reshape, not a copy; each step
    moves its own chunk's heads first (`swap_tokens_and_heads`) while the chunk is in cache.
    Transposing all of q, k, v and the gates to [N, B, H, C, ...] up front cost GDN's forward at
    T 4,096 (H 8, D 128) 15–20% of its time in a profile."""
    B, T = x.shape[:2]
    N = -(-T // C)
    x = jnp.pad(x, [(0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, N, C, *x.shape[2:]), 1, 0)


def swap_tokens_and_heads(x):
    """One chunk [B, C, H, ...] <-> [B, H, C, ...] (its own inverse)."""
    return jnp.swapaxes(x, 1, 2)


def from_chunks(o, T: int):
    """[N, B, C, H, ...] -> [B, T, H, ...], dropping the padding."""
    N, B, C = o.shape[:3]
    return jnp.moveaxis(o, 0, 1).reshape(B, N * C, *o.shape[3:])[:, :T]


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


def _prefix_products(log_gate):
    """The factors of `chunk_factors`, as products of the per-token factors a_t = e^{g_t} ≤ 1.

    Walking up the tree, P holds inclusive prefix products and S exclusive suffix products inside
    blocks of h tokens; the level-h factor is S on the lower half of each 2h block (e^{G_m − G_j})
    and P on its upper half (e^{G_i − G_m}), and doubling h multiplies each half by the other
    half's total. Multiplying factors in (0, 1] never cancels: each result is within C roundings
    of the exact one, and a −1000 reset gives 0 for every product across it."""
    C = log_gate.shape[-2]
    a = jnp.exp(log_gate)
    prefix, suffix = a, jnp.ones_like(a)
    levels = []
    h = 1
    while h < C:
        pairs = lambda x, h=h: x.reshape(*x.shape[:-2], C // (2 * h), 2, h, x.shape[-1])
        p, s = pairs(prefix), pairs(suffix)
        levels.append(jnp.concatenate([s[..., 0, :, :], p[..., 1, :, :]], axis=-2).reshape(a.shape))
        lower_total, upper_total = p[..., 0, h - 1:, :], p[..., 1, h - 1:, :]
        prefix = jnp.stack([p[..., 0, :, :], p[..., 1, :, :] * lower_total], axis=-3).reshape(a.shape)
        suffix = jnp.stack([s[..., 0, :, :] * upper_total, s[..., 1, :, :]], axis=-3).reshape(a.shape)
        h *= 2
    return levels, prefix, suffix


@jax.custom_vjp
def chunk_factors(log_gate):
    """log_gate [..., C, Dg] (fp32, ≤ 0; Dg = 1 broadcasts a scalar gate) -> (levels, from_start,
    to_end): the tree's level factors (a list of log2(C) arrays) and the two chunk-edge decays,
    all [..., C, Dg] and ≤ 1.

    Forward: products of e^{g_t} (`_prefix_products`): one exp per token, then elementwise
    products. Backward: each factor is f = e^{M g} for a 0/1 segment matrix M, so the gradient is
    Σ Mᵀ (f ⊙ df), one matrix product over all factors: faster than computing every factor as
    e^{M g}, and than differentiating through the products (results/bench/HISTORY.md)."""
    return _prefix_products(log_gate)


def _chunk_factors_forward(log_gate):
    factors = _prefix_products(log_gate)
    return factors, factors


def _chunk_factors_backward(factors, grads):
    levels, from_start, to_end = factors
    level_grads, d_from_start, d_to_end = grads
    *batch, C, Dg = from_start.shape
    weighted = jnp.concatenate([f * df for f, df in zip([*levels, from_start, to_end],
                                                       [*level_grads, d_from_start, d_to_end])], axis=-2)
    # Mᵀ broadcast over the batch keeps Dg minor: one batched [C, L·C] × [L·C, Dg] product, where a
    # single shared Mᵀ would make XLA transpose `weighted` to put L·C minor.
    transposed = np.concatenate(list(segment_matrices(C)), axis=0).T            # [C, L·C]
    return (jnp.broadcast_to(jnp.asarray(transposed), (*batch, *transposed.shape)) @ weighted,)


chunk_factors.defvjp(_chunk_factors_forward, _chunk_factors_backward)


def causal_scores(q, k, levels, beta=None):
    """A = tril(Q Kᵀ ⊙ decay) [..., C, C] (diagonal included, decay 1 there) from the level
    factors of `chunk_factors`: the recursive halving above. q, k [..., C, Dk].

    With `beta` [..., C] (the delta rule), also returns T⁻¹ = (I + Diag(β) tril₋₁(K Kᵀ ⊙ decay))⁻¹:
    each level's cross blocks of Diag(β) K Kᵀ ⊙ decay are the off-diagonal blocks of T at that
    level, and `triangular.unit_lower_inverse` inverts T from them by forward substitution in
    blocks (matrix products only: no LAPACK call, whose XLA:CPU kernel can deadlock the worker
    pool it shares with other ops), with a closed-form backward."""
    C = q.shape[-2]
    scores = scaling.row_sums(q * k)[..., None, None]       # [..., C, 1, 1]: decay 1 on the diagonal
    crosses = []                                             # T's off-diagonal blocks, level by level
    for level, f in enumerate(levels):
        h = 2 ** level
        split = lambda x, h=h: x.reshape(*x.shape[:-2], C // (2 * h), 2, h, x.shape[-1])
        qf, kf = split(q * f), split(k * f)
        lower = kf[..., 0, :, :]                               # e^{G_m − G_j} k_j
        scores = triangular.merge_blocks(scores, jnp.einsum("...nid,...njd->...nij", qf[..., 1, :, :], lower))
        if beta is not None:
            crosses.append(split(beta[..., None])[..., 1, :, :] * jnp.einsum("...nid,...njd->...nij",
                                                                             kf[..., 1, :, :], lower))
    scores = scores[..., 0, :, :]
    if beta is None:
        return scores
    return scores, triangular.unit_lower_inverse(crosses) if crosses else jnp.ones_like(scores)  # C = 1: T = I
