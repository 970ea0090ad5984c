"""Pallas (Triton backend) backward kernels for chunked GLA, and the custom_vjp
that differentiates gla_pallas.forward with them.

Two kernels, both one program per (batch, query head, block of Dv columns):

  linjax_gla_chunked_states   the forward state loop only: stores the state
                              entering every chunk, [N, Dk, BV] per program,
                              and the final state (recomputed, not saved by
                              the forward, so the residuals stay the inputs)
  linjax_gla_chunked_bwd      a reverse `lax.fori_loop` over chunks carrying
                              dS (the cotangent of the state after the chunk)
                              and the suffix sum of dG (see below)

Within a chunk (state S_0 before it, G the inclusive cumulative log decay
from the chunk start, dÕ = scale · dO, D = (dÕ Vᵀ) ⊙ M, A as in the forward):

    dQ   = Γ ⊙ (dÕ S_0ᵀ) + Σ_j D_ij k_j ⊙ exp(G_i − G_j)
    dK   = exp(G_last − G) ⊙ (V dSᵀ) + Σ_i D_ij q_i ⊙ exp(G_i − G_j)
    dV   = (A ⊙ M)ᵀ dÕ + (K ⊙ exp(G_last − G)) dS
    dS_0 = Diag(Γ_last) dS + (Q ⊙ Γ)ᵀ dÕ

with the same sub-chunk factorisation as the forward (off-diagonal blocks
split at the boundary before sub-chunk I, diagonal blocks one column at a
time with the mask applied before the exp), every exponent a sum of log α
over exactly its span. The log-gate gradient uses that o and the final state
depend on the global cumulative log decay b_t only through q_t e^{b_t},
k_t e^{−b_t} and the factor e^{b_T} of S_T, so

    dlog α_t = Σ_{u ≥ t} (q_u ⊙ dq_u − k_u ⊙ dk_u) + Σ_e (dS_T ⊙ S_T)[:, e],

a reverse cumulative sum the reverse chunk loop carries (no exponent is
involved). dQ, dK and dlog α are partial sums over one Dv block, and dK, dV
are per query head: the wrapper sums them over Dv blocks and over the query
heads of each GQA group in plain JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels import gla_pallas
from linjax.kernels.pallas_common import (
    MAX_BLOCK_V, SUB, ChunkGates, diag_gram, diag_pair_grads, head_specs, load_rows, matmul, matmul_t,
    offdiag_gram, pad_axis, pad_to_tiles, sum_partial_grads, t_matmul, triton_params)

STATES_NAME = "linjax_gla_chunked_states"
BACKWARD_NAME = "linjax_gla_chunked_bwd"


# -------------------------------------------------------------------- kernels


def _states_kernel(k_ref, v_ref, g_ref, h0_ref, states_ref, ht_ref, *, chunk: int):
    n_sub = chunk // SUB
    n_chunks = k_ref.shape[0] // chunk

    def one_chunk(c, state):
        states_ref[c] = state
        starts = [c * chunk + i * SUB for i in range(n_sub)]
        gates = ChunkGates([load_rows(g_ref, s, SUB) for s in starts])
        state = jnp.exp(gates.whole())[:, None] * state
        for j, s in enumerate(starts):
            k_out = load_rows(k_ref, s, SUB) * jnp.exp(gates.to_end(j))
            state += t_matmul(k_out, load_rows(v_ref, s, SUB))
        return state

    ht_ref[...] = lax.fori_loop(0, n_chunks, one_chunk, h0_ref[...].astype(jnp.float32))


def _gla_bwd_kernel(q_ref, k_ref, v_ref, g_ref, do_ref, states_ref, ht_ref, dht_ref,
                    dq_ref, dk_ref, dv_ref, dg_ref, dh0_ref, *, chunk: int, scale: float):
    n_sub = chunk // SUB
    n_chunks = q_ref.shape[0] // chunk
    at_or_after = jnp.where(lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
                            >= lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0), 1.0, 0.0)

    def one_chunk(r, carry):  # dS: cotangent of the state after chunk c; dg_after: Σ dG after it
        dS, dg_after = carry
        c = n_chunks - 1 - r
        starts = [c * chunk + i * SUB for i in range(n_sub)]
        q = [load_rows(q_ref, s, SUB) for s in starts]
        k = [load_rows(k_ref, s, SUB) for s in starts]
        v = [load_rows(v_ref, s, SUB) for s in starts]
        do = [scale * load_rows(do_ref, s, SUB) for s in starts]
        gates = ChunkGates([load_rows(g_ref, s, SUB) for s in starts])
        state = states_ref[c]  # S before chunk c

        dq = [jnp.exp(gates.from_start(i)) * matmul_t(do[i], state) for i in range(n_sub)]
        k_out = [k[j] * jnp.exp(gates.to_end(j)) for j in range(n_sub)]
        dk = [jnp.exp(gates.to_end(j)) * matmul_t(v[j], dS) for j in range(n_sub)]
        dv = [matmul(k_out[j], dS) for j in range(n_sub)]
        for i in range(n_sub):
            q_in = q[i] * jnp.exp(gates.prefix[i])
            for j in range(i):
                to_boundary = jnp.exp(gates.suffix[j] + gates.between(j + 1, i)[None, :])
                d_ij = matmul_t(do[i], v[j])
                dq[i] += jnp.exp(gates.prefix[i]) * matmul(d_ij, k[j] * to_boundary)
                dk[j] += to_boundary * t_matmul(d_ij, q_in)
                dv[j] += t_matmul(offdiag_gram(q[i], k[j], gates, i, j), do[i])
            dv[i] += t_matmul(diag_gram(q[i], k_ref, starts[i], gates.log_alpha[i], strict=False), do[i])
            dq_diag, dk_diag = diag_pair_grads(q[i], k_ref, starts[i], gates.log_alpha[i],
                                               matmul_t(do[i], v[i]), strict=False)
            dq[i] += dq_diag
            dk[i] += dk_diag

        # dlog α: reverse cumulative sum of q ⊙ dq − k ⊙ dk, carried across chunks.
        for i in reversed(range(n_sub)):
            dg = q[i] * dq[i] - k[i] * dk[i]
            dg_ref[pl.ds(starts[i], SUB)] = matmul(at_or_after, dg) + dg_after[None, :]
            dg_after = dg_after + jnp.sum(dg, axis=0)
            dq_ref[pl.ds(starts[i], SUB)] = dq[i]
            dk_ref[pl.ds(starts[i], SUB)] = dk[i]
            dv_ref[pl.ds(starts[i], SUB)] = dv[i]

        dS = jnp.exp(gates.whole())[:, None] * dS
        for i in range(n_sub):
            dS += t_matmul(q[i] * jnp.exp(gates.from_start(i)), do[i])
        return dS, dg_after

    dht = dht_ref[...].astype(jnp.float32)
    dg_final = jnp.sum(dht * ht_ref[...], axis=1)  # e^{b_T} factor of the final state
    dS, _ = lax.fori_loop(0, n_chunks, one_chunk, (dht, dg_final))
    dh0_ref[...] = dS


# -------------------------------------------------------------------- wrapper


def backward(q, k, v, log_alpha, initial_state, do, dht, *, scale=None, chunk, interpret=False):
    """Gradients (dq, dk, dv, dlog_alpha, dinitial_state) of gla_pallas.forward, given the
    cotangents of o and of the final state, in the inputs' dtypes (None for a missing
    initial state)."""
    (_, _, H, Dk), Hkv = q.shape, k.shape[2]
    padded = pad_to_tiles(q, k, v, log_alpha, initial_state, chunk)
    Tp, Dkp, Dvp = padded[0].shape[1], padded[0].shape[3], padded[2].shape[3]
    do = pad_axis(pad_axis(do, 1, Tp), 3, Dvp)
    dht = pad_axis(pad_axis(dht.astype(jnp.float32), 2, Dkp), 3, Dvp)
    dq, dk, dv, dg, dh0 = _gla_bwd_call(
        *padded, do, dht, group=H // Hkv, chunk=chunk, interpret=bool(interpret),
        scale=Dk ** -0.5 if scale is None else float(scale))
    dq, dk, dv, dg, dh0 = sum_partial_grads(dq, dk, dv, dg, dh0, q=q, k=k, v=v, initial_state=initial_state)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            dg.astype(log_alpha.dtype), dh0)


@functools.partial(jax.jit, static_argnames=("group", "chunk", "scale", "interpret"))
def _gla_bwd_call(q, k, v, log_alpha, h0, do, dht, *, group, chunk, scale, interpret):
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    BV = min(Dv, MAX_BLOCK_V)
    n_v, n_chunks = Dv // BV, Tp // chunk
    specs = head_specs(Tp, Dk, BV, group)
    sq = pl.squeezed
    states = pl.BlockSpec((sq, sq, n_chunks, Dk, BV), lambda b, h, j: (b, h, 0, 0, j))
    partial_spec = pl.BlockSpec((sq, sq, Tp, sq, Dk), lambda b, h, j: (j, b, 0, h, 0))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)

    all_states, ht = pl.pallas_call(
        functools.partial(_states_kernel, chunk=chunk),
        out_shape=(f32(B, H, n_chunks, Dk, Dv), f32(B, H, Dk, Dv)),
        grid=(B, H, n_v),
        in_specs=[specs["k"], specs["v"], specs["gate"], specs["state"]],
        out_specs=(states, specs["state"]),
        compiler_params=triton_params(),
        interpret=interpret,
        name=STATES_NAME,
    )(k, v, log_alpha, h0)

    return pl.pallas_call(
        functools.partial(_gla_bwd_kernel, chunk=chunk, scale=scale),
        out_shape=(f32(n_v, B, Tp, H, Dk), f32(n_v, B, Tp, H, Dk), f32(B, Tp, H, Dv),
                   f32(n_v, B, Tp, H, Dk), f32(B, H, Dk, Dv)),
        grid=(B, H, n_v),
        in_specs=[specs["q"], specs["k"], specs["v"], specs["gate"], specs["o"], states,
                  specs["state"], specs["state"]],
        out_specs=(partial_spec, partial_spec, specs["o"], partial_spec, specs["state"]),
        compiler_params=triton_params(),
        interpret=interpret,
        name=BACKWARD_NAME,
    )(q, k, v, log_alpha, do, all_states, ht, dht)


def differentiable_forward(q, k, v, log_alpha, initial_state, *, scale=None, chunk, interpret=False):
    """gla_pallas.forward under a `jax.custom_vjp` whose backward is the kernels above."""
    options = dict(scale=scale, chunk=chunk, interpret=interpret)

    @jax.custom_vjp
    def run(q, k, v, log_alpha, initial_state):
        return gla_pallas.forward(q, k, v, log_alpha, initial_state=initial_state, **options)

    def run_fwd(*arrays):
        return run(*arrays), arrays

    def run_bwd(arrays, cotangents):
        do, dht = cotangents
        return backward(*arrays, do.astype(arrays[2].dtype), dht, **options)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, log_alpha, initial_state)
