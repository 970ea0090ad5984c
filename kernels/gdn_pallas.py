"""Pallas (Triton backend) forward kernel for the chunked gated delta rule,
Kimi form with a per-channel gate:

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ,   o_t = scale · S_tᵀ q_t.

Writing S_t = Diag(α_t) S_{t-1} + k_t u_tᵀ with u_t = β_t (v_t − (Diag(α_t)
S_{t-1})ᵀ k_t), and with G the cumulative log α from the chunk start (Γ = exp(G)), the
u's of one chunk solve a unit lower-triangular system

    (I + A) U = Diag(β) (V − (K ⊙ Γ) S_0),   A_ij = β_i Σ_d k_id k_jd exp(G_id − G_jd), j < i,

and then

    o   = scale · [(Q ⊙ Γ) S_0 + (B ⊙ M) U],   B_ij = Σ_d q_id k_jd exp(G_id − G_jd), j ≤ i,
    S_C = Diag(Γ_last) S_0 + (K ⊙ exp(G_last − G))ᵀ U.

A and B are built per 16-token sub-chunk with the factorisation described in
`pallas_common` (both factors ≤ 1, exponents summed without cancellation). The system is solved by block forward
substitution over sub-chunks; each 16 × 16 diagonal block is inverted by
forward substitution, row by row, in fp32 (as FLA's `solve_tril` does, from
the equations). Columns of S evolve independently, so programs split Dv.

A scalar (per-head) gate is the per-channel gate broadcast over Dk;
`forward` does that itself.

Gradients: gdn_pallas_backward.py (a state recompute and a reverse chunk loop,
both Pallas kernels in this layout, reusing `chunk_new_values`), wired up by
`gdn.pallas`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.contract import check_shape
from linjax.kernels.pallas_common import (
    MAX_BLOCK_V, SUB, ChunkGates, check_inputs, diag_gram, head_specs, load_rows, matmul,
    offdiag_gram, pad_axis, pad_to_tiles, t_matmul, triton_params)


def unit_lower_inverse(a):
    """(I + A)⁻¹ for a strictly lower-triangular [n, n] A, by forward
    substitution: row i of X = (I + A)⁻¹ is e_i − Σ_{j<i} A_ij X_j."""
    n = a.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    cols = lax.broadcasted_iota(jnp.int32, (n, n), 1)
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)

    def row(i, x):
        # (δ_ij − A_ij) weights on the rows of x; rows ≥ i of x are still e_j.
        w = jnp.sum(jnp.where(rows == i, eye - a, 0.0), axis=0)  # [n], row i
        x_i = jnp.sum(w[:, None] * x, axis=0)
        return jnp.where(rows == i, x_i[None, :], x)

    return lax.fori_loop(1, n, row, eye)


def chunk_new_values(k, v, beta, gates: ChunkGates, k_ref, starts, state):
    """U of one chunk by block forward substitution over its sub-chunks, as a list of
    [SUB, BV] blocks, and the inverses (I + A_II)⁻¹ of the diagonal blocks of the
    system (β folded into A), which the backward reuses."""
    u, inverses = [], []
    for i in range(len(starts)):
        # Right-hand side β (v − (k ⊙ Γ) S_0) minus the solved sub-chunks.
        rhs = beta[i] * (v[i] - matmul(k[i] * jnp.exp(gates.from_start(i)), state))
        for j in range(i):
            rhs -= matmul(beta[i] * offdiag_gram(k[i], k[j], gates, i, j), u[j])
        a_ii = beta[i] * diag_gram(k[i], k_ref, starts[i], gates.log_alpha[i], strict=True)
        inverses.append(unit_lower_inverse(a_ii))
        u.append(matmul(inverses[i], rhs))
    return u, inverses


def _gdn_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, ht_ref, *,
                chunk: int, scale: float):
    n_sub = chunk // SUB
    n_chunks = q_ref.shape[0] // chunk

    def one_chunk(c, state):  # state: [Dk, BV] fp32, S after chunk c − 1
        base = c * chunk
        starts = [base + i * SUB for i in range(n_sub)]
        q = [load_rows(q_ref, s, SUB) for s in starts]
        k = [load_rows(k_ref, s, SUB) for s in starts]
        v = [load_rows(v_ref, s, SUB) for s in starts]
        beta = [load_rows(beta_ref, s, SUB)[:, None] for s in starts]
        gates = ChunkGates([load_rows(g_ref, s, SUB) for s in starts])

        u, _ = chunk_new_values(k, v, beta, gates, k_ref, starts, state)
        for i in range(n_sub):
            acc = matmul(q[i] * jnp.exp(gates.from_start(i)), state)
            for j in range(i):
                acc += matmul(offdiag_gram(q[i], k[j], gates, i, j), u[j])
            acc += matmul(diag_gram(q[i], k_ref, starts[i], gates.log_alpha[i],
                                    strict=False), u[i])
            o_ref[pl.ds(starts[i], SUB)] = (scale * acc).astype(o_ref.dtype)

        state = jnp.exp(gates.whole())[:, None] * state
        for j in range(n_sub):
            state += t_matmul(k[j] * jnp.exp(gates.to_end(j)), u[j])
        return state

    state = lax.fori_loop(0, n_chunks, one_chunk, h0_ref[...].astype(jnp.float32))
    ht_ref[...] = state


def forward(q, k, v, log_alpha, beta, *, scale=None, initial_state=None,
            chunk, interpret=False):
    """Chunked gated-delta-rule forward as one Pallas call (Triton on GPU).

    q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], log_alpha [B,T,H,Dk]
    (per-channel log decay, ≤ 0; a scalar gate [B,T,H] is broadcast over Dk),
    beta [B,T,H] in [0, 1], initial_state [B,H,Dk,Dv] fp32 or None. Returns
    (o [B,T,H,Dv] in v's dtype, final_state [B,H,Dk,Dv] fp32). Not differentiable
    itself: gdn_pallas_backward.differentiable_forward adds the backward kernels.
    """
    if log_alpha.ndim == 3:  # scalar gate per head: the same decay on every channel
        log_alpha = jnp.broadcast_to(log_alpha[..., None], q.shape)
    check_inputs(q, k, v, log_alpha, "log_alpha", initial_state, chunk)
    (B, T, H, Dk), Hkv, Dv = q.shape, k.shape[2], v.shape[3]
    check_shape(beta, (B, T, H), "beta")
    q, k, v, log_alpha, h0 = pad_to_tiles(q, k, v, log_alpha, initial_state, chunk)
    # β = 0 on padded steps makes them the identity on the state.
    beta = pad_axis(beta.astype(jnp.float32), 1, q.shape[1])
    o, ht = _gdn_call(q, k, v, log_alpha, beta, h0, group=H // Hkv, chunk=chunk,
                      interpret=bool(interpret),
                      scale=Dk ** -0.5 if scale is None else float(scale))
    return o[:, :T, :, :Dv], ht[:, :, :Dk, :Dv]


@functools.partial(jax.jit, static_argnames=("group", "chunk", "scale", "interpret"))
def _gdn_call(q, k, v, log_alpha, beta, h0, *, group, chunk, scale, interpret):
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    BV = min(Dv, MAX_BLOCK_V)
    specs = head_specs(Tp, Dk, BV, group)
    return pl.pallas_call(
        functools.partial(_gdn_kernel, chunk=chunk, scale=scale),
        out_shape=(jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype),
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)),
        grid=(B, H, Dv // BV),
        in_specs=[specs["q"], specs["k"], specs["v"], specs["gate"],
                  specs["per_head"], specs["state"]],
        out_specs=(specs["o"], specs["state"]),
        compiler_params=triton_params(),
        interpret=interpret,
        name="linjax_gdn_chunked_fwd",
    )(q, k, v, log_alpha, beta, h0)
