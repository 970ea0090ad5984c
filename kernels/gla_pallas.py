"""Pallas (Triton backend) forward kernel for chunked GLA (the pieces every Pallas
kernel shares are in pallas_common.py).

GLA: S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,  o_t = scale · S_tᵀ q_t.

One program per (batch, query head, block of Dv columns): the columns of S
evolve independently, so splitting Dv only repeats the cheap [C, C] work and
keeps the fp32 state [Dk, BV] small enough for registers. The program loops
over 64-token chunks with `lax.fori_loop`, carrying the state. Inside a
chunk, with G the inclusive cumulative log decay from the chunk start and
Γ = exp(G):

    o_C   = scale · [(Q ⊙ Γ) S_0 + (A ⊙ M) V],  A_ij = Σ_d q_id k_jd exp(G_id − G_jd)
    S_C   = Diag(Γ_last) S_0 + (K ⊙ exp(G_last − G))ᵀ V

The per-channel decay makes A a [C, C, Dk] contraction, so the chunk is cut
into 16-token sub-chunks. An off-diagonal block (I > J) factorises at the
boundary before sub-chunk I, so both factors (decay from that boundary to
i, and from j to it) are ≤ 1: no overflow, and an underflow only where the
true product is smaller still. A diagonal block is built one column at a
time, masking before the exp. This is the layout of FLA's
`fla/ops/gla/chunk.py`, written from the equations.

Every exponent is formed as a sum of log α over exactly the steps it spans
(prefix and suffix sums within a sub-chunk, whole sub-chunk totals between),
never as a difference G_i − G_j of two cumulative sums: with a hard reset
(log α ≈ −1000) such a difference loses all precision in fp32.

The wrapper pads T to a multiple of the chunk (zero keys, log α = 0: the
padded tail leaves the state unchanged) and Dk, Dv to powers of two ≥ 16
(Triton needs power-of-two tiles and matmul sides ≥ 16); zero channels
contribute nothing.

Gradients: gla_pallas_backward.py (a state recompute and a reverse chunk loop,
both Pallas kernels in this layout), wired up by `gla.pallas`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.pallas_common import (
    MAX_BLOCK_V, SUB, ChunkGates, check_inputs, diag_gram, head_specs, load_rows, matmul,
    offdiag_gram, pad_to_tiles, t_matmul, triton_params)

# --------------------------------------------------------------------- kernel


def _gla_kernel(q_ref, k_ref, v_ref, g_ref, h0_ref, o_ref, ht_ref, *,
                chunk: int, scale: float):
    n_sub = chunk // SUB
    n_chunks = q_ref.shape[0] // chunk

    def one_chunk(c, state):  # state: [Dk, BV] fp32, S after chunk c − 1
        base = c * chunk
        starts = [base + i * SUB for i in range(n_sub)]
        q = [load_rows(q_ref, s, SUB) for s in starts]
        k = [load_rows(k_ref, s, SUB) for s in starts]
        v = [load_rows(v_ref, s, SUB) for s in starts]
        gates = ChunkGates([load_rows(g_ref, s, SUB) for s in starts])

        for i in range(n_sub):
            acc = matmul(q[i] * jnp.exp(gates.from_start(i)), state)
            for j in range(i):
                acc += matmul(offdiag_gram(q[i], k[j], gates, i, j), v[j])
            acc += matmul(diag_gram(q[i], k_ref, starts[i], gates.log_alpha[i],
                                    strict=False), v[i])
            o_ref[pl.ds(starts[i], SUB)] = (scale * acc).astype(o_ref.dtype)

        state = jnp.exp(gates.whole())[:, None] * state
        for j in range(n_sub):
            state += t_matmul(k[j] * jnp.exp(gates.to_end(j)), v[j])
        return state

    state = lax.fori_loop(0, n_chunks, one_chunk, h0_ref[...].astype(jnp.float32))
    ht_ref[...] = state


def forward(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk,
            interpret=False):
    """Chunked GLA forward as one Pallas call (Triton on GPU).

    q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], log_alpha [B,T,H,Dk] (log
    decay, ≤ 0), initial_state [B,H,Dk,Dv] fp32 or None. Returns
    (o [B,T,H,Dv] in v's dtype, final_state [B,H,Dk,Dv] fp32). Not differentiable
    itself: gla_pallas_backward.differentiable_forward adds the backward kernels.
    """
    check_inputs(q, k, v, log_alpha, "log_alpha", initial_state, chunk)
    (_, T, H, Dk), Hkv, Dv = q.shape, k.shape[2], v.shape[3]
    padded = pad_to_tiles(q, k, v, log_alpha, initial_state, chunk)
    o, ht = _gla_call(*padded, group=H // Hkv, chunk=chunk, interpret=bool(interpret),
                      scale=Dk ** -0.5 if scale is None else float(scale))
    return o[:, :T, :, :Dv], ht[:, :, :Dk, :Dv]


@functools.partial(jax.jit, static_argnames=("group", "chunk", "scale", "interpret"))
def _gla_call(q, k, v, log_alpha, h0, *, group, chunk, scale, interpret):
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    BV = min(Dv, MAX_BLOCK_V)
    specs = head_specs(Tp, Dk, BV, group)
    return pl.pallas_call(
        functools.partial(_gla_kernel, chunk=chunk, scale=scale),
        out_shape=(jax.ShapeDtypeStruct((B, Tp, H, Dv), v.dtype),
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)),
        grid=(B, H, Dv // BV),
        in_specs=[specs["q"], specs["k"], specs["v"], specs["gate"], specs["state"]],
        out_specs=(specs["o"], specs["state"]),
        compiler_params=triton_params(),
        interpret=interpret,
        name="linjax_gla_chunked_fwd",
    )(q, k, v, log_alpha, h0)
