"""The decays of the chunked Pallas kernels, from log-gates, exact to a few roundings at any gate.

Inside a chunk of C tokens with per-channel (or per-head scalar) log-gates g_t ≤ 0, the kernels need
e^{G_i − G_j} for j ≤ i, G_i = Σ_{t≤i} g_t. Written as a difference of two cumulative sums over the
chunk, it loses |G|·ε: after a hard reset (g = −1000) every later pair is off by 1e-4. So the chunk is
cut into sub-chunks of 16 tokens and each gets its own cumulative sum

    b_i = Σ_{t ≤ i, t in i's sub-chunk} g_t,    B_s = b at the last token of sub-chunk s,

from which every decay is a product of factors ≤ 1:

    inside sub-chunk s     e^{G_i − G_j} = e^{b_i − b_j}
    across (s > r)         e^{G_i − G_j} = e^{b_i} · Π_{r<u<s} e^{B_u} · e^{B_r − b_j}
    from the chunk start   Γ_i = Π_{u<s} e^{B_u} · e^{b_i}
    to its end             e^{G_C − G_j} = e^{B_r − b_j} · Π_{u>r} e^{B_u}

Gates are clamped at −20 first (e^{−20} ≈ 2e-9: what crosses such a gate is negligible either way,
and its gradient is zero in the reference too), so |b| stays within 16 · 20 and each decay within a
few ε·|b| of exact.

    sub_chunk_cumsum(log_gate)   [B, T, H, Dg] fp32 (T a multiple of 16) -> b, same shape
    gate_gradient(d_cumulative, chunk)  ∂L/∂G per token -> ∂L/∂g: sums over the rest of each chunk
"""

from __future__ import annotations

import jax.numpy as jnp

from linjax.kernels.pallas_common import SUB

GATE_FLOOR = -20.0


def clamp(log_gate):
    """Log-gates below GATE_FLOOR raised to it (a hard reset stays a reset: e^{−20} ≈ 2e-9)."""
    return jnp.maximum(log_gate, GATE_FLOOR)


def sub_chunk_cumsum(log_gate):
    """Inclusive cumulative sums of log_gate [B, T, H, Dg] (T a multiple of 16) within each run of 16 tokens."""
    B, T, H, Dg = log_gate.shape
    return jnp.cumsum(log_gate.reshape(B, T // SUB, SUB, H, Dg), axis=2).reshape(B, T, H, Dg)


def gate_gradient(d_cumulative, chunk: int):
    """∂L/∂g_t = Σ_{i ≥ t in t's chunk} ∂L/∂G_i, from the kernels' gradient with respect to the chunk's
    cumulative log-decay G_i, [B, T, H, Dg] fp32 (T a multiple of `chunk`)."""
    B, T, H, Dg = d_cumulative.shape
    blocks = d_cumulative.reshape(B, T // chunk, chunk, H, Dg)
    return jnp.flip(jnp.cumsum(jnp.flip(blocks, 2), axis=2), 2).reshape(B, T, H, Dg)
