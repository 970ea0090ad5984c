"""Gated delta rule (the paper's "GDN", Kimi Delta Attention form), pure JAX.

Per query head, with keys/values repeated to the query heads (HF `repeat_kv`):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ        S ∈ R^{Dk×Dv}
    o_t = scale · S_tᵀ q_t                                          (S_t includes token t)

`log_alpha` is log α_t, either per channel [B,T,H,Dk] (Kimi / the paper's GDN) or one
scalar per head [B,T,H] (the original GDN); the rank tells which. Gates are expected to
be ≤ 0 (e.g. LogSigmoid); −inf-like values such as −1000 are a hard reset. q and k are
used as given: the caller L2-normalises them.

Functions (docs/architecture.md, "Kernel contract"):
    reference  fp32 `lax.scan` over tokens: the spec.
    chunked    chunk-parallel WY/UT form, what training uses; differentiable by autodiff.
    step       one decode token.
    pallas     FLA's decomposition as Pallas (Triton) kernels, forward and backward (chunk_pallas.py).
All return (o [B,T,H,Dv] in v's dtype, final_state [B,H,Dk,Dv] fp32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linjax.kernels import chunk_pallas, chunk_states, decay, scaling
from linjax.kernels.contract import (
    as_token_batch,
    check_qkv,
    check_shape,
    default_scale,
    expand_kv_heads,
    initial_state_or_zeros,
)
from linjax.kernels.pallas_common import check_pallas_chunk

__all__ = ["reference", "chunked", "step", "pallas", "CHUNK", "GPU_CHUNK", "PALLAS_CHUNK"]

# Default chunk of `chunked` on a CPU: there the 64-wide block inverse and decay tree cost more than
# the shorter scan over chunks saves, and 16 was no faster than 32 (results/bench/HISTORY.md).
CHUNK = 32
# Default chunk of `pallas`: that measurement does not carry over to a GPU, where the in-chunk work is
# batched over all chunks and a longer chunk means fewer serial steps of the state pass. 64 is the
# block FLA's delta-rule kernels use; untuned (no GPU was at hand).
PALLAS_CHUNK = 64


# ----------------------------------------------------------------------------- inputs


def _prepare(q, k, v, log_alpha, beta, state, scale, *, per_token=False):
    """Checked fp32 inputs with k, v repeated to the query heads and a trailing gate axis
    (Dk, or 1 for a scalar gate, which then broadcasts over Dk everywhere). `per_token`:
    one decode token, shapes without the T axis."""
    B, _, H, _, Dk, Dv = (as_token_batch if per_token else check_qkv)(q, k, v)
    heads = q.shape[:-1]
    if log_alpha.shape == q.shape:
        per_channel = True
    elif log_alpha.shape == heads:
        per_channel = False
    else:
        raise ValueError(f"log_alpha must be {q.shape} (per channel) or {heads} (scalar per "
                         f"head); got {log_alpha.shape}")
    check_shape(beta, heads, "beta")
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    la = f32(log_alpha) if per_channel else f32(log_alpha)[..., None]
    state = initial_state_or_zeros(state, (B, H, Dk, Dv), "state" if per_token else "initial_state")
    return (f32(q), f32(expand_kv_heads(k, H)), f32(expand_kv_heads(v, H)), la, f32(beta), state,
            default_scale(scale, Dk))


# ---------------------------------------------------------------------- recurrent form


def _update(S, q, k, v, la, beta, scale):
    """One token of the recurrence, all [B,H,...] fp32. Written as
    S' = Diag(α)S + β k (v − kᵀ Diag(α)S)ᵀ, which equals (I − βkkᵀ)Diag(α)S + βkvᵀ."""
    S = S * jnp.exp(la)[..., None]                                   # Diag(α_t) S_{t-1}
    err = v - jnp.einsum("bhk,bhkv->bhv", k, S)                      # v_t − kᵀ Diag(α) S
    S = S + jnp.einsum("bhk,bhv->bhkv", k, beta[..., None] * err)
    return S, scale * jnp.einsum("bhk,bhkv->bhv", q, S)


def step(q, k, v, log_alpha, beta, *, state, scale=None):
    """One decode token. q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], log_alpha [B,H,Dk] or
    [B,H], beta [B,H], state [B,H,Dk,Dv] fp32 (or None for zeros).
    Returns (o [B,H,Dv] in v's dtype, new_state [B,H,Dk,Dv] fp32)."""
    q32, k32, v32, la, b, S, scale = _prepare(q, k, v, log_alpha, beta, state, scale,
                                              per_token=True)
    S, o = _update(S, q32, k32, v32, la, b, scale)
    return o.astype(v.dtype), S


def reference(q, k, v, log_alpha, beta, *, scale=None, initial_state=None):
    """The spec: the recurrence token by token in fp32 with `lax.scan`.
    q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], log_alpha [B,T,H,Dk] or [B,T,H],
    beta [B,T,H], initial_state [B,H,Dk,Dv] or None.
    Returns (o [B,T,H,Dv] in v's dtype, final_state [B,H,Dk,Dv] fp32)."""
    q32, k32, v32, la, b, S, scale = _prepare(q, k, v, log_alpha, beta, initial_state, scale)
    time_first = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_first, (q32, k32, v32, la, b)))
    S, o = jax.lax.scan(lambda S, x: _update(S, *x, scale), S, xs)
    return time_first(o).astype(v.dtype), S


# -------------------------------------------------------------------- chunk-parallel form
#
# Inside a chunk of C tokens with state S_0 on entry, write Γ_i = exp(G_i), G_i = Σ_{t≤i} log α_t
# (per channel) and S_i = Diag(α_i) S_{i-1} + k_i u_iᵀ with the "new value"
# u_i = β_i (v_i − k_iᵀ Diag(α_i) S_{i-1}). Unrolling S_{i-1} gives, for all i at once,
#
#     u_i + β_i Σ_{j<i} A_ij u_j = β_i (v_i − (k_i ⊙ Γ_i)ᵀ S_0),   A_ij = Σ_d k_id k_jd e^{G_id − G_jd}
#
# a unit lower-triangular system (I + Diag(β) tril₋₁(A)) U = Diag(β)(V − (K⊙Γ) S_0). Its solution
# is U = Ũ − W S_0 with Ũ = T⁻¹Diag(β)V and W = T⁻¹Diag(β)(K⊙Γ) (the WY / UT transform), which
# need no state and are computed for every chunk in parallel. The scan over chunks is then
#     U = Ũ − W S_0,   S_C = Diag(Γ_C) S_0 + (K ⊙ e^{G_C − G})ᵀ U,
# and outputs are o = scale·[(Q⊙Γ) S_0 + tril(A^{qk}) U], A^{qk}_ij = Σ_d q_id k_jd e^{G_id − G_jd}.
#
# The decays inside a chunk (Γ, e^{G_C − G}, and the decayed scores A^{qk} and A with T⁻¹) come
# from decay.py, exact at any gate.
#
# On a CPU, all of a chunk's work runs inside one step of the scan over chunks, heads batched, so its [C, D]
# blocks stay in cache between the dozens of small operations on them; the step is recomputed in
# the backward (jax.checkpoint) rather than its intermediates stored: on a CPU this beat forming
# everything for all chunks at once in time and memory (results/bench/HISTORY.md).


def chunked(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=None):
    """Chunk-parallel gated delta rule; same arguments and results as `reference`.
    `chunk` (a power of two) is the block length, by default CHUNK on a CPU and GPU_CHUNK
    elsewhere; any T works (padded inside with β = 0, log α = 0, which leave the state unchanged).
    Memory is linear in T.

    The form follows the platform the program is lowered for (`lax.platform_dependent`): on a CPU
    each chunk's work runs inside the scan over chunks (`_chunk_scan`); elsewhere the in-chunk work
    is batched over all chunks and the scan carries only the state (`_chunks_then_states`)."""
    q32, k32, v32, la, beta32, S0, scale = _prepare(q, k, v, log_alpha, beta, initial_state, scale)
    args = (q32, k32, v32, la, beta32, S0)
    o, S_final = jax.lax.platform_dependent(
        *args, cpu=functools.partial(_chunk_scan, chunk=CHUNK if chunk is None else chunk),
        default=functools.partial(_chunks_then_states, chunk=GPU_CHUNK if chunk is None else chunk,
                                  state_pass=chunk_states.scan))
    return (o * scale).astype(v.dtype), S_final


def _chunk_scan(q32, k32, v32, la, beta32, S0, *, chunk):
    """The CPU form: one scan over chunks, each chunk's whole work in its step. Returns the
    unscaled outputs [B,T,H,Dv] and the final state."""
    T = q32.shape[1]
    C = decay.chunk_length(chunk, T)

    def chunk_step(S, x):                                  # S: the state entering the chunk
        q, k, v, la, beta = map(decay.swap_tokens_and_heads, x)       # [B,H,C,...]
        tree, from_start, to_end = decay.chunk_factors(la)          # [B,H,C,Dg] each, all ≤ 1
        a_qk, t_inv = decay.causal_scores(q, k, tree, beta)         # A^{qk} and T⁻¹, [B,H,C,C]
        t_inv = scaling.scale_cols(t_inv, beta)            # T⁻¹Diag(β): then W and Ũ are two matmuls
        w_and_q = jnp.concatenate([t_inv @ (k * from_start), q * from_start], axis=-2)
        read = w_and_q @ S                                 # [W; Q⊙Γ] S_0 in one product
        u = t_inv @ v - read[..., :C, :]                   # U = Ũ − W S_0
        o = read[..., C:, :] + a_qk @ u
        k_out_t = jnp.swapaxes(k * to_end, -1, -2)         # (k_j ⊙ e^{G_C − G_j})ᵀ
        return scaling.scale_rows(from_start[..., -1, :], S) + k_out_t @ u, decay.swap_tokens_and_heads(o)

    xs = tuple(decay.to_chunks(x, C) for x in (q32, k32, v32, la, beta32))
    S_final, o = jax.lax.scan(jax.checkpoint(chunk_step), S0, xs)
    return decay.from_chunks(o, T), S_final


# On a GPU the scan above is bound by kernel launches (hundreds of small operations per chunk step,
# T/C steps). FLA's decomposition instead does every chunk's state-free work at once, as batched
# operations over [N, B, H, C, ...]:
#   (K1) the decays, A^{qk}, T⁻¹, W = T⁻¹Diag(β)(K⊙Γ), Ũ = T⁻¹Diag(β)V, Q⊙Γ and K⊙e^{G_C − G};
#   (K2) one pass over the chunks carrying only the state, two matmuls a chunk (chunk_states.py);
#   (K3) every chunk's outputs o = (Q⊙Γ) S_n + A^{qk} U_n from the states K2 returns.
# `pallas` runs the same three steps, and their backward, as Pallas kernels (chunk_pallas.py).
GPU_CHUNK = 64


def in_chunk_xla(q, k, v, la, beta):
    """K1 as batched XLA operations on [..., C, D] fp32 blocks (any leading axes):
    (A^{qk} [..., C, C], W, Ũ, Q⊙Γ, K⊙e^{G_C − G} [..., C, D], Γ_C [..., Dg])."""
    tree, from_start, to_end = decay.chunk_factors(la)
    a_qk, t_inv = decay.causal_scores(q, k, tree, beta)
    t_inv = scaling.scale_cols(t_inv, beta)
    return a_qk, t_inv @ (k * from_start), t_inv @ v, q * from_start, k * to_end, from_start[..., -1, :]


def _chunks_then_states(q32, k32, v32, la, beta32, S0, *, chunk, state_pass, in_chunk=in_chunk_xla, min_chunk=1):
    """K1 (`in_chunk`, in_chunk_xla's signature), K2 (`state_pass`, chunk_states.scan's signature), K3
    on fp32 inputs as `_prepare` gives them. Returns the unscaled outputs [B,T,H,Dv] and the final
    state. `min_chunk` raises the chunk of a short input (a Pallas dot needs 16 rows)."""
    T = q32.shape[1]
    C = max(decay.chunk_length(chunk, T), min(min_chunk, chunk))
    heads_first = lambda x: jnp.swapaxes(decay.to_chunks(x, C), 2, 3)          # [N,B,H,C,...]
    a_qk, w, u_tilde, q_gated, k_out, chunk_decay = in_chunk(*map(heads_first, (q32, k32, v32, la, beta32)))
    states, u, S_final = state_pass(k_out, u_tilde, w, chunk_decay, S0)
    o = q_gated @ states + a_qk @ u
    return decay.from_chunks(jnp.swapaxes(o, 2, 3), T), S_final


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=PALLAS_CHUNK, interpret=None):
    """`chunked` as FLA's decomposition in Pallas (Triton) kernels, forward and backward
    (chunk_pallas.py); same arguments and results, per-channel or scalar gate. Dot operands are in
    v's dtype with fp32 accumulation. `chunk`: a power of two ≥ 16. interpret=None: compiled where the
    program is lowered for a GPU, interpreted on a CPU."""
    check_pallas_chunk(chunk)
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    if T == 0:
        raise ValueError("sequence length T must be at least 1")
    heads = q.shape[:-1]
    if log_alpha.shape == q.shape:
        gate = log_alpha
    elif log_alpha.shape == heads:
        gate = log_alpha[..., None]
    else:
        raise ValueError(f"log_alpha must be {q.shape} (per channel) or {heads} (scalar per head); "
                         f"got {log_alpha.shape}")
    check_shape(beta, heads, "beta")
    state = initial_state_or_zeros(initial_state, (B, H, Dk, Dv))
    return chunk_pallas.chunk_attention(q, k, v, gate, beta, state, scale=default_scale(scale, Dk), chunk=chunk,
                                        interpret=interpret)
