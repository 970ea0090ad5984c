"""Gated linear attention (GLA): S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,  o_t = scale · S_tᵀ q_t.

The paper's GLA update (sec. 3.1.2, "State-Based Linear Attention"); α_t is a
per-channel decay given in log space, log α ≤ 0 (0 = keep, −∞ = reset).

    reference(q, k, v, log_alpha, *, scale=None, initial_state=None) -> (o, final_state)
    chunked(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=None) -> (o, final_state)
    step(q, k, v, log_alpha, *, state=None, scale=None) -> (o, new_state)
    pallas(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=PALLAS_CHUNK, interpret=None)
        -> (o, final_state)

Shapes: q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], log_alpha [B,T,H,Dk];
H is a multiple of Hkv and query head h reads kv head h // (H // Hkv) (HF
`repeat_kv`), so there is one state per query head: [B,H,Dk,Dv], fp32.
`step` takes one token without the time axis: q [B,H,Dk], k [B,Hkv,Dk],
v [B,Hkv,Dv], log_alpha [B,H,Dk]. Dtypes as in contract.py (o in v's dtype,
fp32 gates, sums and states). The kernels take q and k as given (no feature
map, no L2 norm). kgla.py and linear_attn.py reuse the recurrence here
(`decayed_update`, `scan_recurrence`, `chunked_scan`).

On a CPU the token scan (`reference`) is the faster forward (a [Dk, Dv] update
per token is cheap there); `chunked` is the one to differentiate, and the
parallel form for accelerators.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

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

# Default chunk of `chunked` on a CPU (a power of two): 32 had the faster forward (results/bench/HISTORY.md).
CHUNK = 32
# Default chunk of `pallas`: a longer chunk shortens the serial state pass and adds only batched
# [C, C] work; 64 is the block FLA's GLA kernels use. Untuned (no GPU was at hand).
PALLAS_CHUNK = 64


# ------------------------------------------------------------- the recurrence


def decayed_update(state, q, k, v, alpha, scale):
    """One token of S_t = Diag(α) S_{t-1} + k vᵀ and o = scale · Sᵀ q, fp32.

    state [B,H,Dk,Dv]; q, k, alpha [B,H,Dk]; v [B,H,Dv]; alpha=None means no decay.
    """
    if alpha is not None:
        state = alpha[..., None] * state
    state = state + jnp.einsum("bhd,bhe->bhde", k, v)
    return state, scale * jnp.einsum("bhd,bhde->bhe", q, state)


def scan_recurrence(q, k, v, alpha, state, scale):
    """lax.scan of `decayed_update` over time; all inputs fp32 on H heads, [B,T,H,D]."""
    time_major = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)

    def one_token(S, xs):
        return decayed_update(S, *xs, scale)

    state, o = lax.scan(one_token, state, tuple(map(time_major, (q, k, v, alpha))))
    return jnp.swapaxes(o, 0, 1), state


def reference(q, k, v, log_alpha, *, scale=None, initial_state=None):
    """The spec: token-by-token fp32 recurrence (decay exp(log α_t) applied per step)."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    check_shape(log_alpha, (B, T, H, Dk), "log_alpha ([B, T, H, Dk])")
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    o, state = scan_recurrence(f32(q), f32(expand_kv_heads(k, H)), f32(expand_kv_heads(v, H)),
                               jnp.exp(f32(log_alpha)), initial_state_or_zeros(initial_state, (B, H, Dk, Dv)),
                               scale)
    return o.astype(v.dtype), state


def step(q, k, v, log_alpha, *, state=None, scale=None):
    """One decode token: q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], log_alpha [B,H,Dk] -> (o [B,H,Dv], state)."""
    B, _, H, _, Dk, Dv = as_token_batch(q, k, v)
    check_shape(log_alpha, (B, H, Dk), "log_alpha ([B, H, Dk])")
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    state = initial_state_or_zeros(state, (B, H, Dk, Dv), "state")
    state, o = decayed_update(state, f32(q), f32(expand_kv_heads(k, H)), f32(expand_kv_heads(v, H)),
                              jnp.exp(f32(log_alpha)), scale)
    return o.astype(v.dtype), state


# ------------------------------------------------------------ chunk-parallel form
#
# Within a chunk of C tokens (log-gates g_i, state S_0 from before the chunk):
#   o_a = (q_a ⊙ exp Σ_{i≤a} g_i)ᵀ S_0 + Σ_{b≤a} (Σ_d q_ad k_bd exp Σ_{b<i≤a} g_id) v_b
#   S_C = Diag(exp Σ_i g_i) S_0 + Σ_b (k_b ⊙ exp Σ_{i>b} g_i) v_bᵀ
# The three decays (from the chunk start, to its end, and the per-channel pair decay inside the
# causal scores) come from decay.py, which forms every decay as a product of the per-token factors
# e^{g} it spans and never builds the [C, C, Dk] pair decay: exact next to a −1000 reset, no overflow.
# On a CPU, as in gdn.py, all of a chunk's work runs in one step of the scan over chunks (its blocks stay in
# cache), recomputed in the backward rather than stored.


def chunked_scan(q, k, v, log_gate, state, chunk=None):
    """Chunk-parallel GLA on already expanded heads: q (pre-scaled), k, log_gate [B,T,H,Dk], v [B,T,H,Dv],
    state [B,H,Dk,Dv], all fp32; log_gate=None means no decay. Returns (o [B,T,H,Dv], final state).

    `chunk` is a power of two (None: CHUNK on a CPU, GPU_CHUNK elsewhere); T is padded to whole
    chunks with zero keys and zero log-gates, which leave the state unchanged. As in gdn.chunked,
    the form follows the platform the program is lowered for: `_chunk_scan` on a CPU,
    `_chunks_then_states` elsewhere.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if T == 0:
        return jnp.zeros((B, 0, H, Dv), jnp.float32), state
    cpu_chunk, gpu_chunk = (CHUNK, GPU_CHUNK) if chunk is None else (chunk, chunk)
    if log_gate is None:  # platform_dependent takes arrays only
        return lax.platform_dependent(
            q, k, v, state, cpu=lambda q, k, v, S: _chunk_scan(q, k, v, None, S, cpu_chunk),
            default=lambda q, k, v, S: _chunks_then_states(q, k, v, None, S, chunk=gpu_chunk,
                                                           state_pass=chunk_states.scan))
    return lax.platform_dependent(
        q, k, v, log_gate, state, cpu=functools.partial(_chunk_scan, chunk=cpu_chunk),
        default=functools.partial(_chunks_then_states, chunk=gpu_chunk, state_pass=chunk_states.scan))


def _chunk_scan(q, k, v, log_gate, state, chunk):
    """The CPU form: a lax.scan carries the state over chunks and forms each chunk's outputs there,
    so it hands back o [C, Dv] per chunk, not the [Dk, Dv] state each chunk starts from."""
    T = q.shape[1]
    C = decay.chunk_length(chunk, T)

    def chunk_step(S, x):                                    # S: the state entering the chunk
        q, k, v, log_gate = (None if a is None else decay.swap_tokens_and_heads(a) for a in x)  # [B,H,C,...]
        if log_gate is None:
            scores = jnp.tril(q @ jnp.swapaxes(k, -1, -2))   # causal q kᵀ, no decay
            q_in, k_out, chunk_decay = q, k, None
        else:
            levels, from_start, to_end = decay.chunk_factors(log_gate)
            scores = decay.causal_scores(q, k, levels)       # [B,H,C,C]
            q_in, k_out, chunk_decay = q * from_start, k * to_end, from_start[..., -1, :]
        o = q_in @ S + scores @ v
        S = S if chunk_decay is None else scaling.scale_rows(chunk_decay, S)
        return S + jnp.swapaxes(k_out, -1, -2) @ v, decay.swap_tokens_and_heads(o)

    xs = tuple(None if x is None else decay.to_chunks(x, C) for x in (q, k, v, log_gate))
    state, o = lax.scan(jax.checkpoint(chunk_step), state, xs)
    return decay.from_chunks(o, T), state


# FLA's decomposition, as in gdn.py: (K1) the decays, causal scores, Q⊙Γ and K⊙e^{G_C − G} of all
# chunks at once; (K2) one pass over the chunks carrying only the state (chunk_states.py); (K3) every
# chunk's outputs (Q⊙Γ) S_n + A V_n in parallel. `pallas` runs K2 as a Pallas kernel.
GPU_CHUNK = 64


def _chunks_then_states(q, k, v, log_gate, state, *, chunk, state_pass, min_chunk=1):
    """K1, K2 (`state_pass`, chunk_states.scan's signature), K3; arguments and results as
    `_chunk_scan`. `min_chunk` raises the chunk of a short input (a Pallas dot needs 16 rows)."""
    T = q.shape[1]
    C = max(decay.chunk_length(chunk, T), min(min_chunk, chunk))
    heads_first = lambda x: None if x is None else jnp.swapaxes(decay.to_chunks(x, C), 2, 3)  # [N,B,H,C,...]
    q, k, v, log_gate = map(heads_first, (q, k, v, log_gate))
    if log_gate is None:
        scores, q_in, k_out, chunk_decay = jnp.tril(q @ jnp.swapaxes(k, -1, -2)), q, k, None
    else:
        levels, from_start, to_end = decay.chunk_factors(log_gate)
        scores = decay.causal_scores(q, k, levels)
        q_in, k_out, chunk_decay = q * from_start, k * to_end, from_start[..., -1, :]
    states, _, final = state_pass(k_out, v, None, chunk_decay, state)
    o = q_in @ states + scores @ v
    return decay.from_chunks(jnp.swapaxes(o, 2, 3), T), final


def chunked(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=None):
    """Chunk-parallel GLA (the training path): same result as `reference`, linear memory in T, any T."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    check_shape(log_alpha, (B, T, H, Dk), "log_alpha ([B, T, H, Dk])")
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    o, state = chunked_scan(f32(q) * scale, f32(expand_kv_heads(k, H)), f32(expand_kv_heads(v, H)),
                            f32(log_alpha), initial_state_or_zeros(initial_state, (B, H, Dk, Dv)), chunk)
    return o.astype(v.dtype), state


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=PALLAS_CHUNK, interpret=None):
    """`chunked` as FLA's decomposition in Pallas (Triton) kernels, forward and backward
    (chunk_pallas.py); same arguments and results. `log_alpha` None: no decay (linear_attn.py). Dot
    operands are in v's dtype with fp32 accumulation. `chunk`: a power of two ≥ 16. interpret=None:
    compiled where the program is lowered for a GPU, interpreted on a CPU."""
    check_pallas_chunk(chunk)
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    if log_alpha is not None:
        check_shape(log_alpha, (B, T, H, Dk), "log_alpha")
    if T == 0:
        raise ValueError("sequence length T must be at least 1")
    state = initial_state_or_zeros(initial_state, (B, H, Dk, Dv))
    return chunk_pallas.chunk_attention(q, k, v, log_alpha, None, state, scale=default_scale(scale, Dk), chunk=chunk,
                                        interpret=interpret)
