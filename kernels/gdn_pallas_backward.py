"""Pallas (Triton backend) backward kernels for the chunked gated delta rule,
and the custom_vjp that differentiates gdn_pallas.forward with them.

Two kernels, one program per (batch, query head, block of Dv columns), as in
gla_pallas_backward.py: `linjax_gdn_chunked_states` reruns the forward state
loop and stores the state entering every chunk; `linjax_gdn_chunked_bwd` runs
a reverse `lax.fori_loop` over chunks carrying dS (the cotangent of the state
after the chunk) and the suffix sum of dG, recomputing each chunk's U from its
stored S_0 (gdn_pallas.chunk_new_values).

With the forward's notation (T = I + Diag(β) tril₋₁(A), R = Diag(β)(V − (K⊙Γ) S_0),
U = T⁻¹ R, o = scale·[(Q⊙Γ) S_0 + (B ⊙ M) U], S_C = Diag(Γ_last) S_0 + (K⊙e^{G_last−G})ᵀ U)
and dÕ = scale · dO:

    dU   = (B ⊙ M)ᵀ dÕ + (K ⊙ e^{G_last − G}) dS
    dR   = T⁻ᵀ dU                       (block back substitution over sub-chunks)
    dV   = Diag(β) dR,   dT = −tril₋₁(dR Uᵀ),   dA = Diag(β) dT
    dβ_i = dR_i · (v_i − (k_i ⊙ Γ_i)ᵀ S_0) + Σ_j dT_ij A_ij
    dS_0 = Diag(Γ_last) dS + (Q ⊙ Γ)ᵀ dÕ − (K ⊙ Γ)ᵀ dV

and dQ, dK from the Gram blocks B (weights dÕ Uᵀ) and A (weights dA), the
S_0 terms and the S_C term, with the forward's sub-chunk factorisation and
every exponent a sum of log α over exactly its span. For dlog α: in the
rescaled state S̃_t = Diag(e^{−b_t}) S_t (b the global cumulative log α) the
recurrence depends on b only through q e^{b}, k e^{b} (k as the key read
against the old state), k e^{−b} (k as the key written) and the e^{b_T} of
S_T, so dlog α_t is the reverse cumulative sum of
q ⊙ dq + k ⊙ dk_read − k ⊙ dk_written plus Σ_e (dS_T ⊙ S_T)[:, e].
dQ, dK, dβ and dlog α are partial sums over one Dv block, dK, dV per query
head: the wrapper sums over Dv blocks and GQA groups in plain JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels import gdn_pallas
from linjax.kernels.pallas_common import (
    MAX_BLOCK_V, SUB, ChunkGates, diag_gram, diag_pair_grads, head_specs, load_rows, matmul, matmul_t,
    offdiag_gram, pad_axis, pad_to_tiles, sum_partial_grads, t_matmul, triton_params)

STATES_NAME = "linjax_gdn_chunked_states"
BACKWARD_NAME = "linjax_gdn_chunked_bwd"


def _load_chunk(refs, c, chunk):
    q_ref, k_ref, v_ref, g_ref, beta_ref = refs
    starts = [c * chunk + i * SUB for i in range(chunk // SUB)]
    rows = lambda ref: [load_rows(ref, s, SUB) for s in starts]
    beta = [b[:, None] for b in rows(beta_ref)]
    return starts, rows(q_ref), rows(k_ref), rows(v_ref), beta, ChunkGates(rows(g_ref))


# -------------------------------------------------------------------- kernels


def _states_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, states_ref, ht_ref, *, chunk: int):
    refs = (q_ref, k_ref, v_ref, g_ref, beta_ref)

    def one_chunk(c, state):
        states_ref[c] = state
        starts, _, k, v, beta, gates = _load_chunk(refs, c, chunk)
        u, _ = gdn_pallas.chunk_new_values(k, v, beta, gates, k_ref, starts, state)
        state = jnp.exp(gates.whole())[:, None] * state
        for j in range(len(starts)):
            state += t_matmul(k[j] * jnp.exp(gates.to_end(j)), u[j])
        return state

    ht_ref[...] = lax.fori_loop(0, k_ref.shape[0] // chunk, one_chunk, h0_ref[...].astype(jnp.float32))


def _gdn_bwd_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, do_ref, states_ref, ht_ref, dht_ref,
                    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, dh0_ref, *, chunk: int, scale: float):
    refs = (q_ref, k_ref, v_ref, g_ref, beta_ref)
    n_sub = chunk // SUB
    n_chunks = q_ref.shape[0] // chunk
    at_or_after = jnp.where(lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
                            >= lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0), 1.0, 0.0)

    def one_chunk(r, carry):
        dS, dg_after = carry
        c = n_chunks - 1 - r
        starts, q, k, v, beta, gates = _load_chunk(refs, c, chunk)
        do = [scale * load_rows(do_ref, s, SUB) for s in starts]
        la = gates.log_alpha
        state = states_ref[c]
        u, inverses = gdn_pallas.chunk_new_values(k, v, beta, gates, k_ref, starts, state)
        decay_in = [jnp.exp(gates.from_start(i)) for i in range(n_sub)]
        decay_out = [jnp.exp(gates.to_end(j)) for j in range(n_sub)]
        head = [jnp.exp(gates.prefix[i]) for i in range(n_sub)]  # decay within sub-chunk i
        tail = {(i, j): jnp.exp(gates.suffix[j] + gates.between(j + 1, i)[None, :])
                for i in range(n_sub) for j in range(i)}  # from row j to the boundary before i
        a_off = {(i, j): matmul_t(k[i] * head[i], k[j] * tail[i, j])
                 for i in range(n_sub) for j in range(i)}

        # Outputs: dU, dQ, and dK as the written key (k e^{-G}).
        du = [matmul(k[j] * decay_out[j], dS) for j in range(n_sub)]
        dq = [decay_in[i] * matmul_t(do[i], state) for i in range(n_sub)]
        dk_written = [decay_out[j] * matmul_t(u[j], dS) for j in range(n_sub)]
        for i in range(n_sub):
            for j in range(i):
                d_ij = matmul_t(do[i], u[j])
                dq[i] += head[i] * matmul(d_ij, k[j] * tail[i, j])
                dk_written[j] += tail[i, j] * t_matmul(d_ij, q[i] * head[i])
                du[j] += t_matmul(offdiag_gram(q[i], k[j], gates, i, j), do[i])
            du[i] += t_matmul(diag_gram(q[i], k_ref, starts[i], la[i], strict=False), do[i])
            dq_ii, dk_ii = diag_pair_grads(q[i], k_ref, starts[i], la[i], matmul_t(do[i], u[i]),
                                           strict=False)
            dq[i] += dq_ii
            dk_written[i] += dk_ii

        # dR = T⁻ᵀ dU by back substitution, T_IJ = β_I A_IJ below the diagonal.
        dr = [None] * n_sub
        for j in reversed(range(n_sub)):
            rhs = du[j]
            for i in range(j + 1, n_sub):
                rhs -= t_matmul(beta[i] * a_off[i, j], dr[i])
            dr[j] = t_matmul(inverses[j], rhs)
        dv = [beta[i] * dr[i] for i in range(n_sub)]

        # The system: dβ, and dK as the read key (k e^{G}) and as the written one.
        dk_read = [-decay_in[i] * matmul_t(dv[i], state) for i in range(n_sub)]
        dbeta = [jnp.sum(dr[i] * (v[i] - matmul(k[i] * decay_in[i], state)), axis=1) for i in range(n_sub)]
        for i in range(n_sub):
            for j in range(i):
                dt = -matmul_t(dr[i], u[j])
                dbeta[i] += jnp.sum(dt * a_off[i, j], axis=1)
                dk_read[i] += head[i] * matmul(beta[i] * dt, k[j] * tail[i, j])
                dk_written[j] += tail[i, j] * t_matmul(beta[i] * dt, k[i] * head[i])
            dt = -matmul_t(dr[i], u[i])
            a_ii = diag_gram(k[i], k_ref, starts[i], la[i], strict=True)
            dbeta[i] += jnp.sum(dt * a_ii, axis=1)
            dk_ii_read, dk_ii_written = diag_pair_grads(k[i], k_ref, starts[i], la[i], beta[i] * dt,
                                                        strict=True)
            dk_read[i] += dk_ii_read
            dk_written[i] += dk_ii_written

        for i in reversed(range(n_sub)):
            dg = q[i] * dq[i] + k[i] * (dk_read[i] - dk_written[i])
            dg_ref[pl.ds(starts[i], SUB)] = matmul(at_or_after, dg) + dg_after[None, :]
            dg_after = dg_after + jnp.sum(dg, axis=0)
            dq_ref[pl.ds(starts[i], SUB)] = dq[i]
            dk_ref[pl.ds(starts[i], SUB)] = dk_read[i] + dk_written[i]
            dv_ref[pl.ds(starts[i], SUB)] = dv[i]
            dbeta_ref[pl.ds(starts[i], SUB)] = dbeta[i]

        dS = jnp.exp(gates.whole())[:, None] * dS
        for i in range(n_sub):
            dS += t_matmul(q[i] * decay_in[i], do[i]) - t_matmul(k[i] * decay_in[i], dv[i])
        return dS, dg_after

    dht = dht_ref[...].astype(jnp.float32)
    dg_final = jnp.sum(dht * ht_ref[...], axis=1)  # e^{b_T} factor of the final state
    dS, _ = lax.fori_loop(0, n_chunks, one_chunk, (dht, dg_final))
    dh0_ref[...] = dS


# -------------------------------------------------------------------- wrapper


def backward(q, k, v, log_alpha, beta, initial_state, do, dht, *, scale=None, chunk, interpret=False):
    """Gradients (dq, dk, dv, dlog_alpha, dbeta, dinitial_state) of gdn_pallas.forward with a
    per-channel gate, given the cotangents of o and of the final state, in the inputs'
    dtypes (None for a missing initial state)."""
    (_, T, H, Dk), Hkv = q.shape, k.shape[2]
    padded = pad_to_tiles(q, k, v, log_alpha, initial_state, chunk)
    Tp, Dkp, Dvp = padded[0].shape[1], padded[0].shape[3], padded[2].shape[3]
    beta_p = pad_axis(beta.astype(jnp.float32), 1, Tp)
    do = pad_axis(pad_axis(do, 1, Tp), 3, Dvp)
    dht = pad_axis(pad_axis(dht.astype(jnp.float32), 2, Dkp), 3, Dvp)
    dq, dk, dv, dg, dbeta, dh0 = _gdn_bwd_call(
        *padded[:4], beta_p, padded[4], do, dht, group=H // Hkv, chunk=chunk, interpret=bool(interpret),
        scale=Dk ** -0.5 if scale is None else float(scale))
    dq, dk, dv, dg, dh0 = sum_partial_grads(dq, dk, dv, dg, dh0, q=q, k=k, v=v, initial_state=initial_state)
    dbeta = dbeta.sum(0)[:, :T]
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg.astype(log_alpha.dtype),
            dbeta.astype(beta.dtype), dh0)


@functools.partial(jax.jit, static_argnames=("group", "chunk", "scale", "interpret"))
def _gdn_bwd_call(q, k, v, log_alpha, beta, h0, do, dht, *, group, chunk, scale, interpret):
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    BV = min(Dv, MAX_BLOCK_V)
    n_v, n_chunks = Dv // BV, Tp // chunk
    specs = head_specs(Tp, Dk, BV, group)
    sq = pl.squeezed
    states = pl.BlockSpec((sq, sq, n_chunks, Dk, BV), lambda b, h, j: (b, h, 0, 0, j))
    partial_spec = pl.BlockSpec((sq, sq, Tp, sq, Dk), lambda b, h, j: (j, b, 0, h, 0))
    partial_beta = pl.BlockSpec((sq, sq, Tp, sq), lambda b, h, j: (j, b, 0, h))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    inputs = [specs["q"], specs["k"], specs["v"], specs["gate"], specs["per_head"]]
    common = dict(grid=(B, H, n_v), compiler_params=triton_params(), interpret=interpret)

    all_states, ht = pl.pallas_call(
        functools.partial(_states_kernel, chunk=chunk),
        out_shape=(f32(B, H, n_chunks, Dk, Dv), f32(B, H, Dk, Dv)),
        in_specs=[*inputs, specs["state"]], out_specs=(states, specs["state"]),
        name=STATES_NAME, **common,
    )(q, k, v, log_alpha, beta, h0)

    return pl.pallas_call(
        functools.partial(_gdn_bwd_kernel, chunk=chunk, scale=scale),
        out_shape=(f32(n_v, B, Tp, H, Dk), f32(n_v, B, Tp, H, Dk), f32(B, Tp, H, Dv),
                   f32(n_v, B, Tp, H, Dk), f32(n_v, B, Tp, H), f32(B, H, Dk, Dv)),
        in_specs=[*inputs, specs["o"], states, specs["state"], specs["state"]],
        out_specs=(partial_spec, partial_spec, specs["o"], partial_spec, partial_beta, specs["state"]),
        name=BACKWARD_NAME, **common,
    )(q, k, v, log_alpha, beta, do, all_states, ht, dht)


def differentiable_forward(q, k, v, log_alpha, beta, initial_state, *, scale=None, chunk, interpret=False):
    """gdn_pallas.forward under a `jax.custom_vjp` whose backward is the kernels above. A
    scalar gate [B,T,H] is broadcast over Dk first, so autodiff sums its gradient."""
    if log_alpha.ndim == 3:
        log_alpha = jnp.broadcast_to(log_alpha[..., None], q.shape)
    options = dict(scale=scale, chunk=chunk, interpret=interpret)

    @jax.custom_vjp
    def run(q, k, v, log_alpha, beta, initial_state):
        return gdn_pallas.forward(q, k, v, log_alpha, beta, initial_state=initial_state, **options)

    def run_fwd(*arrays):
        return run(*arrays), arrays

    def run_bwd(arrays, cotangents):
        do, dht = cotangents
        return backward(*arrays, do.astype(arrays[2].dtype), dht, **options)

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, log_alpha, beta, initial_state)
