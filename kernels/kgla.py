"""Key-gated linear attention (kGLA): S_t = Diag(α_t)(I − β_t Diag(k_t ⊙ k_t)) S_{t-1} + k_t v_tᵀ.

The paper's kGLA (sec. 3.2.1, "Gated Linear Attention with Key-Dependent
Gate"): the diagonal of GDN's rank-1 erase, folded into the GLA gate. Both
factors are diagonal, so kGLA is GLA with the log-gate

    log α_t + log(1 − β_t k_t²),

and `chunked` reuses the GLA chunk kernel. The erase factor 1 − β k² is
floored at `floor` (default 1e-6, i.e. log ≥ −13.8): with L2-normalised keys
and β = sigmoid(·) ∈ (0, 1) it is always positive, but unnormalised keys or a
β near 1 on a one-hot key would otherwise give log 0 = −∞ or a negative decay.
The gradient through a floored entry is zero.

    reference(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, floor=1e-6) -> (o, final_state)
    chunked(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=None, floor=1e-6) -> (o, final_state)
    step(q, k, v, log_alpha, beta, *, state=None, scale=None, floor=1e-6) -> (o, new_state)

Shapes as in gla.py, plus beta [B,T,H] (step: [B,H]), per query head; the
key of query head h is k[..., h // (H // Hkv), :]. State [B,H,Dk,Dv] fp32.
"""

from __future__ import annotations

import jax.numpy as jnp

from linjax.kernels import gla
from linjax.kernels.contract import (
    as_token_batch,
    check_qkv,
    check_shape,
    default_scale,
    expand_kv_heads,
    initial_state_or_zeros,
)

KEY_GATE_FLOOR = 1e-6
CHUNK = gla.CHUNK  # kGLA runs the GLA chunk kernel on a combined gate: its chunk, for the same reasons


def key_log_gate(log_alpha, beta, k, floor=KEY_GATE_FLOOR):
    """log α + log max(1 − β k², floor), fp32. log_alpha, k [..., H, Dk] (k expanded to H heads), beta [..., H]."""
    erase = beta.astype(jnp.float32)[..., None] * jnp.square(k.astype(jnp.float32))
    return log_alpha.astype(jnp.float32) + jnp.log1p(-jnp.minimum(erase, 1.0 - floor))


def _key_decay(log_alpha, beta, k, floor):
    """The reference's multiplicative form: α ⊙ max(1 − β k², floor), written without the log."""
    erase = beta.astype(jnp.float32)[..., None] * jnp.square(k.astype(jnp.float32))
    return jnp.exp(log_alpha.astype(jnp.float32)) * jnp.maximum(1.0 - erase, floor)


def _check_gates(log_alpha, beta, B, T, H, Dk):
    check_shape(log_alpha, (B, T, H, Dk), "log_alpha ([B, T, H, Dk])")
    check_shape(beta, (B, T, H), "beta ([B, T, H])")


def reference(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, floor=KEY_GATE_FLOOR):
    """The spec: token-by-token fp32 recurrence with the decay α ⊙ max(1 − β k², floor) per step."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    _check_gates(log_alpha, beta, B, T, H, Dk)
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    k = f32(expand_kv_heads(k, H))
    o, state = gla.scan_recurrence(f32(q), k, f32(expand_kv_heads(v, H)), _key_decay(log_alpha, beta, k, floor),
                                   initial_state_or_zeros(initial_state, (B, H, Dk, Dv)), scale)
    return o.astype(v.dtype), state


def chunked(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=None, floor=KEY_GATE_FLOOR):
    """Chunk-parallel kGLA: the GLA chunk kernel on the combined log-gate."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    _check_gates(log_alpha, beta, B, T, H, Dk)
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    k = f32(expand_kv_heads(k, H))
    o, state = gla.chunked_scan(f32(q) * scale, k, f32(expand_kv_heads(v, H)),
                                key_log_gate(log_alpha, beta, k, floor),
                                initial_state_or_zeros(initial_state, (B, H, Dk, Dv)), chunk)
    return o.astype(v.dtype), state


def step(q, k, v, log_alpha, beta, *, state=None, scale=None, floor=KEY_GATE_FLOOR):
    """One decode token: q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], log_alpha [B,H,Dk], beta [B,H]."""
    B, _, H, _, Dk, Dv = as_token_batch(q, k, v)
    check_shape(log_alpha, (B, H, Dk), "log_alpha ([B, H, Dk])")
    check_shape(beta, (B, H), "beta ([B, H])")
    scale = default_scale(scale, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    k = f32(expand_kv_heads(k, H))
    state, o = gla.decayed_update(initial_state_or_zeros(state, (B, H, Dk, Dv), "state"), f32(q), k,
                                  f32(expand_kv_heads(v, H)), _key_decay(log_alpha, beta, k, floor), scale)
    return o.astype(v.dtype), state


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=gla.PALLAS_CHUNK,
           floor=KEY_GATE_FLOOR, interpret=None):
    """`chunked` with the GLA Pallas kernel on the combined log-gate (gla.pallas; its
    backward is GLA's Pallas backward kernels, whose log-gate gradient flows into the
    combined gate, whose own gradient is plain autodiff)."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    _check_gates(log_alpha, beta, B, T, H, Dk)
    log_gate = key_log_gate(log_alpha, beta, expand_kv_heads(k, H), floor)
    return gla.pallas(q, k, v, log_gate, scale=scale, initial_state=initial_state, chunk=chunk,
                      interpret=interpret)
