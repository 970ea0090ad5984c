"""The contract every linear-attention kernel keeps (docs/architecture.md, "Kernel contract"), and its checks.

Each mechanism module (gla, kgla, gdn, linear_attn) exposes

    reference(q, k, v, *gates, scale=None, initial_state=None) -> (o, final_state)   fp32 lax.scan: the spec
    chunked(q, k, v, *gates, scale=None, initial_state=None, chunk=CHUNK) -> (o, final_state)
    step(q, k, v, *gates, state, scale=None) -> (o, new_state)                     one decode token
    pallas(q, k, v, *gates, scale=None, initial_state=None, chunk=..., interpret=None) -> (o, final_state)

Layout [batch, time, heads, dim]: q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv];
`step` takes one token without the time axis. H is a multiple of Hkv and query
head h reads kv head h // (H // Hkv) (HF `repeat_kv`), so there is one state
per query head, [B,H,Dk,Dv] fp32. The default scale is Dk^-1/2.

Dtypes: inputs may be bf16; gates, cumulative sums, states and accumulations
are fp32, and o comes back in v's dtype. v's rather than q's because o is a
weighted sum of values (FLA's ops allocate o like v); the only exception is an
unnormalised output meant for a later division (linear_attn with
normalize=False), which stays fp32 so the division is not rounded twice.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def check_qkv(q, k, v):
    """(B, T, H, Hkv, Dk, Dv) of [B,T,H,Dk], [B,T,Hkv,Dk], [B,T,Hkv,Dv]; raises a readable error otherwise."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, time, heads, dim]; got shape {x.shape}")
    B, T, H, Dk = q.shape
    Hkv = k.shape[2]
    if k.shape[:2] != (B, T) or k.shape[3] != Dk:
        raise ValueError(f"k must be [B, T, Hkv, Dk] = [{B}, {T}, Hkv, {Dk}] to match q {q.shape}; got {k.shape}")
    if v.shape[:3] != (B, T, Hkv):
        raise ValueError(f"v must be [B, T, Hkv, Dv] = [{B}, {T}, {Hkv}, Dv] to match k {k.shape}; got {v.shape}")
    if H % Hkv:
        raise ValueError(
            f"query heads ({H}) must be a multiple of key/value heads ({Hkv}): query head h reads "
            f"kv head h // (H // Hkv); with {Hkv} kv heads, H must be a multiple of kv heads")
    return B, T, H, Hkv, Dk, v.shape[3]


def as_token_batch(q, k, v):
    """Checks one-token step inputs q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv]; returns (B, 1, H, Hkv, Dk, Dv)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"step takes one token without a time axis: {name} must be [batch, heads, dim]; "
                             f"got shape {x.shape}")
    return check_qkv(q[:, None], k[:, None], v[:, None])


def check_shape(x, expected, name):
    """Raise `{name} must be of shape ...` unless x has exactly the shape `expected`."""
    if x is None or tuple(x.shape) != tuple(expected):
        found = None if x is None else tuple(x.shape)
        raise ValueError(f"{name} must be of shape {tuple(expected)}; got {found}")


def default_scale(scale, key_dim):
    """The output scale: Dk^-1/2 unless given."""
    return key_dim ** -0.5 if scale is None else scale


def expand_kv_heads(x, heads):
    """[..., Hkv, D] -> [..., H, D], each kv head repeated for its H // Hkv consecutive query heads."""
    return jnp.repeat(x, heads // x.shape[-2], axis=-2)


def initial_state_or_zeros(initial_state, shape, name="initial_state"):
    """The given state as fp32 after a shape check, or zeros of `shape`.

    The zeros pass an optimization barrier: jaxlib 0.10's CPU "ynn" fusion
    miscompiles a chunk whose state is a broadcast constant (garbage outputs
    for Dk = 64 under jit; XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=
    also avoids it). Keeping the zeros opaque costs nothing.
    """
    if initial_state is None:
        return lax.optimization_barrier(jnp.zeros(shape, jnp.float32))
    check_shape(initial_state, shape, name)
    return initial_state.astype(jnp.float32)
