"""Normalised linear attention (the Hedgehog form): o_t = qᵀS_t / qᵀz_t, S_t = Σ k_i v_iᵀ, z_t = Σ k_i (i ≤ t).

The paper's eq. (normalized-linear-attention), with the feature maps already
applied: pass φ(q), φ(k) as q, k (the kernel applies none). It runs as GLA
with no decay on the values with a column of ones appended, [v, 1]: the last
output column is then the normaliser scale · qᵀz_t, and the state carries
both sums, the normaliser's z beside S:

    state [B, H, Dk, Dv + 1] fp32:  state[..., :Dv] = S,  state[..., Dv] = z.

    reference(q, k, v, *, scale=None, initial_state=None, normalize=True, eps=1e-10) -> (out, state)
    chunked(q, k, v, *, scale=None, initial_state=None, chunk=None, normalize=True, eps=1e-10) -> (out, state)
    step(q, k, v, *, state=None, scale=None, normalize=True, eps=1e-10) -> (out, new_state)
    pallas(q, k, v, *, scale=None, initial_state=None, chunk=gla.PALLAS_CHUNK, normalize=True, eps=1e-10,
           interpret=None) -> (out, state)

Like every kernel, two results; the first is a `NormalizedOutput(o, normaliser)`
because the per-token normaliser is an output, not a state (it is not fed
back; its running sum z is what the state carries). normaliser [B,T,H]
(step: [B,H]) = scale · qᵀz_t, fp32. With normalize=True, o = numerator /
(normaliser + eps) in v's dtype (eps as in FLA's naive reference; the feature
maps are expected positive, e.g. Hedgehog's softmax features, so the
normaliser is > 0). With normalize=False, o is the raw numerator
scale · S_tᵀq_t in fp32, for a mixer that adds a softmax window's numerator
and denominator before one shared division (LoLCATs).
The scale cancels in the normalised output; it is kept so that the
numerator and normaliser are on the same scale as the other kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linjax.kernels import chunk_pallas, gla
from linjax.kernels.contract import as_token_batch, check_qkv, default_scale, expand_kv_heads, initial_state_or_zeros

CHUNK = gla.CHUNK  # the GLA chunk kernel without gates: its chunk, for the same reasons


class NormalizedOutput(NamedTuple):
    """The first result of every function here."""

    o: jax.Array  # [..., H, Dv]: numerator / (normaliser + eps), or the fp32 numerator with normalize=False
    normaliser: jax.Array  # [..., H] fp32: scale · qᵀz_t


def _append_ones(v):
    return jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)


def _finish(out, dtype, normalize, eps):
    """Split [..., Dv+1] fp32 outputs into NormalizedOutput(normalised o or numerator, normaliser)."""
    numerator, normaliser = out[..., :-1], out[..., -1]
    if normalize:
        return NormalizedOutput((numerator / (normaliser[..., None] + eps)).astype(dtype), normaliser)
    return NormalizedOutput(numerator, normaliser)


def reference(q, k, v, *, scale=None, initial_state=None, normalize=True, eps=1e-10):
    """The spec: token-by-token fp32 sums S_t, z_t (no decay)."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    state = initial_state_or_zeros(initial_state, (B, H, Dk, Dv + 1))
    out, state = gla.scan_recurrence(f32(q), f32(expand_kv_heads(k, H)),
                                     _append_ones(f32(expand_kv_heads(v, H))), None, state,
                                     default_scale(scale, Dk))
    return _finish(out, v.dtype, normalize, eps), state


def chunked(q, k, v, *, scale=None, initial_state=None, chunk=None, normalize=True, eps=1e-10):
    """Chunk-parallel form: the GLA chunk kernel without gates (causal q kᵀ per chunk)."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    state = initial_state_or_zeros(initial_state, (B, H, Dk, Dv + 1))
    out, state = gla.chunked_scan(f32(q) * default_scale(scale, Dk), f32(expand_kv_heads(k, H)),
                                  _append_ones(f32(expand_kv_heads(v, H))), None, state, chunk)
    return _finish(out, v.dtype, normalize, eps), state


def step(q, k, v, *, state=None, scale=None, normalize=True, eps=1e-10):
    """One decode token: q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], state [B,H,Dk,Dv+1]."""
    B, _, H, _, Dk, Dv = as_token_batch(q, k, v)
    f32 = lambda x: x.astype(jnp.float32)
    state, out = gla.decayed_update(initial_state_or_zeros(state, (B, H, Dk, Dv + 1), "state"), f32(q),
                                    f32(expand_kv_heads(k, H)), _append_ones(f32(expand_kv_heads(v, H))),
                                    None, default_scale(scale, Dk))
    return _finish(out, v.dtype, normalize, eps), state


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, *, scale=None, initial_state=None, chunk=gla.PALLAS_CHUNK, normalize=True, eps=1e-10,
           interpret=None):
    """`chunked` with the numerator from the chunked Pallas kernels without a decay (chunk_pallas.py,
    forward and backward; dot operands in v's dtype, the numerator in fp32) and the normaliser carried
    as its own state: scale · qᵀz_t with z_t = z_0 + Σ_{i≤t} k_i,
    a cumulative sum in fp32 (so neither is rounded to v's dtype, nor padded to a value column)."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    state = initial_state_or_zeros(initial_state, (B, H, Dk, Dv + 1))
    scale = default_scale(scale, Dk)
    numerator, S = chunk_pallas.chunk_attention(q, k, v, None, None, state[..., :Dv], scale=scale, chunk=chunk,
                                                out_dtype=jnp.float32, interpret=interpret)
    k_sums = jnp.cumsum(expand_kv_heads(k, H).astype(jnp.float32), axis=1) + state[:, None, :, :, Dv]  # z_t
    normaliser = scale * jnp.einsum("bthd,bthd->bth", q.astype(jnp.float32), k_sums)
    out = jnp.concatenate([numerator, normaliser[..., None]], axis=-1)
    return _finish(out, v.dtype, normalize, eps), jnp.concatenate([S, k_sums[:, -1, :, :, None]], axis=-1)
