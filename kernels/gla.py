"""Gated linear attention (GLA): S_t = Diag(α_t) S_{t-1} + k_t v_tᵀ,  o_t = scale · S_tᵀ q_t.

The paper's GLA update (sec. 3.1.2, "State-Based Linear Attention"); α_t is a
per-channel decay given in log space, log α ≤ 0 (0 = keep, −∞ = reset).

    reference(q, k, v, log_alpha, *, scale=None, initial_state=None) -> (o, final_state)
    chunked(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=CHUNK) -> (o, final_state)
    step(q, k, v, log_alpha, *, state=None, scale=None) -> (o, new_state)
    pallas(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=CHUNK, interpret=None) -> (o, final_state)

Shapes: q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], log_alpha [B,T,H,Dk];
H is a multiple of Hkv and query head h reads kv head h // (H // Hkv) (HF
`repeat_kv`), so there is one state per query head: [B,H,Dk,Dv], fp32.
`step` takes one token without the time axis: q [B,H,Dk], k [B,Hkv,Dk],
v [B,Hkv,Dv], log_alpha [B,H,Dk]. Dtypes as in contract.py (o in v's dtype,
fp32 gates, sums and states). The kernels take q and k as given (no feature
map, no L2 norm). kgla.py and linear_attn.py reuse the recurrence here
(`decayed_update`, `scan_recurrence`, `chunked_scan`).

Speed on CPU (2 cores, B=1, T=2048, H=8, Hkv=2, D=64, jit): chunked 69 ms
forward / 319 ms forward+backward, reference 13 ms / 620 ms. The scan is the
faster forward on CPU (a [Dk, Dv] update per token is cheap there); chunked
is the one to differentiate, and the parallel form for accelerators.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from linjax.kernels import gla_pallas
from linjax.kernels.contract import (as_token_batch, check_qkv, check_shape, default_scale, expand_kv_heads,
                                     initial_state_or_zeros)
from linjax.kernels.pallas_common import default_interpret, with_chunked_backward

SUBCHUNK = 16  # intra-chunk block length for the per-channel decay tensor [sub, sub, Dk]
# Default chunk of `chunked` and `pallas`. The [sub, sub, Dk] pair decay is only built inside 16-token
# sub-chunks, so a longer chunk adds only [C, C] matmuls and shortens the serial scan over chunks; 64
# (four sub-chunks) is the block FLA's GLA kernels use. The Pallas kernel walks the same 16-token
# sub-chunks, so one value serves both.
CHUNK = 64


# ------------------------------------------------------------- the recurrence


def decayed_update(state, q, k, v, decay, scale):
    """One token of S_t = Diag(decay) S_{t-1} + k vᵀ and o = scale · Sᵀ q, fp32.

    state [B,H,Dk,Dv]; q, k, decay [B,H,Dk]; v [B,H,Dv]; decay=None means no decay.
    """
    if decay is not None:
        state = decay[..., None] * state
    state = state + jnp.einsum("bhd,bhe->bhde", k, v)
    return state, scale * jnp.einsum("bhd,bhde->bhe", q, state)


def scan_recurrence(q, k, v, decay, state, scale):
    """lax.scan of `decayed_update` over time; all inputs fp32 on H heads, [B,T,H,D]."""
    time_major = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)

    def one_token(S, xs):
        return decayed_update(S, *xs, scale)

    state, o = lax.scan(one_token, state, tuple(map(time_major, (q, k, v, decay))))
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
# Every exponent is a sum of log-gates over exactly the positions it spans,
# formed from cumulative sums that start at the span's own end, never as the
# difference of two long cumulative sums: it is ≤ 0 (no overflow) and has no
# cancellation, so a −1000 reset next to a −0.01 gate keeps the small one exact.
# The per-channel pair decay is a [C, C, Dk] tensor; it is only built for
# 16-token diagonal blocks. An off-diagonal block (query sub-chunk s, key
# sub-chunk s' < s) factors at the boundary r = start of s:
#   exp Σ_{b<i≤a} g = exp Σ_{r≤i≤a} g · exp Σ_{b<i<r} g,   both factors ≤ 1,
# so it is a plain matmul of (q ⊙ first) with (k ⊙ second).


def _segment_sums(g):
    """g [..., L, D] -> X [..., L(a), L(b), D] with X = Σ_{b<i≤a} g_i for a ≥ b and −inf above the diagonal.

    Built as a cumulative sum over a of g masked to i > b, so each entry only
    adds the gates it spans; the −inf is set before any exp (no inf·0 in grads).
    """
    L = g.shape[-2]
    a = jnp.arange(L)[:, None]
    b = jnp.arange(L)[None, :]
    spans = jnp.where((a > b)[:, :, None], g[..., :, None, :], 0.0)  # [..., i, b, D]: g_i where i > b
    return jnp.where((a >= b)[:, :, None], jnp.cumsum(spans, axis=-3), -jnp.inf)


def _sum_after(g, axis):
    """Σ_{i>a} g_i along `axis` (reverse exclusive cumsum, built without subtraction)."""
    shifted = jnp.concatenate([lax.slice_in_dim(g, 1, None, axis=axis),
                               jnp.zeros_like(lax.slice_in_dim(g, 0, 1, axis=axis))], axis=axis)
    return lax.cumsum(shifted, axis=axis, reverse=True)


def _ungated_chunk(state, q, k, v):
    """Chunk of plain linear attention (no decay): causal q kᵀ within the chunk, q S_0 across."""
    C = q.shape[2]
    causal = jnp.tril(jnp.ones((C, C), bool))
    scores = jnp.where(causal, jnp.einsum("bhid,bhjd->bhij", q, k), 0.0)
    o = jnp.einsum("bhad,bhde->bhae", q, state) + jnp.einsum("bhij,bhje->bhie", scores, v)
    return state + jnp.einsum("bhcd,bhce->bhde", k, v), o


def _gated_chunk(state, q, k, v, g, sub):
    """One chunk of GLA (see the block comment above). q (pre-scaled), k, g [B,H,C,Dk]; v [B,H,C,Dv]."""
    B, H, C, Dk = q.shape
    Dv = v.shape[-1]
    n = C // sub

    # Across chunks: what S_0 contributes, and the state handed to the next chunk.
    from_start = jnp.cumsum(g, axis=2)  # Σ_{i≤a}
    o = jnp.einsum("bhad,bhde->bhae", q * jnp.exp(from_start), state)
    state = (jnp.exp(from_start[:, :, -1])[..., None] * state
             + jnp.einsum("bhcd,bhce->bhde", k * jnp.exp(_sum_after(g, axis=2)), v))

    # Diagonal sub-blocks: the full per-channel pair decay, [n, sub, sub, Dk].
    gs, qs, ks, vs = (x.reshape(B, H, n, sub, x.shape[-1]) for x in (g, q, k, v))
    pair_decay = jnp.exp(_segment_sums(gs))
    scores = jnp.einsum("bhnid,bhnjd,bhnijd->bhnij", qs, ks, pair_decay)
    within = jnp.einsum("bhnij,bhnje->bhnie", scores, vs)

    if n > 1:  # Off-diagonal sub-blocks, factored at the start of the query sub-chunk.
        local_from_start = jnp.cumsum(gs, axis=3)  # Σ_{start(s)≤i≤a}
        local_to_end = _sum_after(gs, axis=3)  # Σ_{b<i≤end(s')}
        totals = local_from_start[:, :, :, -1]  # [B,H,n,Dk] per sub-chunk
        # between[s, s'] = Σ over whole sub-chunks s'+1 .. s-1, −inf unless s' < s.
        spans = _segment_sums(totals)  # [B,H,n,n,Dk]
        between = jnp.concatenate([jnp.full((B, H, 1, n, Dk), -jnp.inf), spans[:, :, :-1]], axis=2)
        key_decay = jnp.exp(between[:, :, :, :, None, :] + local_to_end[:, :, None])  # [B,H,s,s',b,Dk]
        keys = (ks[:, :, None] * key_decay).reshape(B, H, n, C, Dk)
        queries = qs * jnp.exp(local_from_start)
        cross = jnp.einsum("bhsad,bhsjd->bhsaj", queries, keys)  # [B,H,n,sub,C]
        within = within + jnp.einsum("bhsaj,bhje->bhsae", cross, v)

    return state, o + within.reshape(B, H, C, Dv)


def chunked_scan(q, k, v, log_gate, state, chunk):
    """Chunk-parallel GLA on already expanded heads: q (pre-scaled), k, log_gate [B,T,H,Dk], v [B,T,H,Dv],
    state [B,H,Dk,Dv], all fp32; log_gate=None means no decay. Returns (o [B,T,H,Dv], final state).

    T is padded to whole chunks with zero keys and zero log-gates, which leave
    the state unchanged. A lax.scan carries the state over chunks; each chunk
    body is rematerialised in the backward pass (jax.checkpoint), so autodiff
    stores one [Dk, Dv] state per chunk instead of the [sub, sub, Dk] decays.
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    sub = min(SUBCHUNK, chunk)
    if chunk < 1 or chunk % sub:
        raise ValueError(f"chunk must be a positive multiple of {SUBCHUNK} (or smaller than it); got {chunk}")
    if T == 0:
        return jnp.zeros((B, 0, H, Dv), jnp.float32), state
    C = min(chunk, sub * math.ceil(T / sub))  # short sequences use one short chunk
    N = math.ceil(T / C)

    def to_chunks(x):  # [B,T,H,D] -> [N,B,H,C,D]
        x = jnp.pad(x, ((0, 0), (0, N * C - T), (0, 0), (0, 0)))
        return x.reshape(B, N, C, H, x.shape[-1]).transpose(1, 0, 3, 2, 4)

    if log_gate is None:
        body = lambda S, xs: _ungated_chunk(S, *xs)
        xs = tuple(map(to_chunks, (q, k, v)))
    else:
        body = lambda S, xs: _gated_chunk(S, *xs, sub)
        xs = tuple(map(to_chunks, (q, k, v, log_gate)))
    state, o = lax.scan(jax.checkpoint(body), state, xs)
    o = o.transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, Dv)[:, :T]
    return o, state


def chunked(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=CHUNK):
    """Chunk-parallel GLA (the training path): same result as `reference`, linear memory in T, any T."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    check_shape(log_alpha, (B, T, H, Dk), "log_alpha ([B, T, H, Dk])")
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    o, state = chunked_scan(f32(q) * scale, f32(expand_kv_heads(k, H)), f32(expand_kv_heads(v, H)),
                            f32(log_alpha), initial_state_or_zeros(initial_state, (B, H, Dk, Dv)), chunk)
    return o.astype(v.dtype), state


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, log_alpha, *, scale=None, initial_state=None, chunk=CHUNK, interpret=None):
    """`chunked` as one Pallas (Triton) kernel, see gla_pallas.py; same arguments and results.

    Differentiable through a `jax.custom_vjp` whose backward recomputes through `chunked`
    (exact, not a fused backward kernel). interpret=None runs the Pallas interpreter when
    the default backend is CPU."""
    interpret = default_interpret(interpret)
    kernel = lambda *a: gla_pallas.forward(*a[:-1], initial_state=a[-1], scale=scale, chunk=chunk,
                                          interpret=interpret)
    spec = lambda *a: chunked(*a[:-1], initial_state=a[-1], scale=scale, chunk=chunk)
    o, state = with_chunked_backward(kernel, spec, q, k, v, log_alpha, initial_state)
    return o.astype(v.dtype), state
