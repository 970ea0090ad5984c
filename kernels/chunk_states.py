"""The only sequential part of the chunked gated kernels: the chunk-to-chunk state recurrence.

In FLA's decomposition of a chunked kernel, everything inside a chunk (decays, decayed scores, the
delta rule's WY solve) is computed for all chunks at once, and one pass over the chunks carries the
state. With chunk n's state-free tensors

    k_out [C, Dk]  keys decayed to the chunk's end, K ⊙ e^{G_C − G}
    values [C, Dv] what the chunk writes: V for GLA, Ũ = T⁻¹Diag(β)V for the delta rule
    w [C, Dk]      the delta rule's W = T⁻¹Diag(β)(K ⊙ Γ) (None for GLA)
    decay [Dg]     the whole chunk's decay e^{G_C} (Dg = Dk, or 1 for a scalar gate; None: no decay)

the pass is

    U_n = values_n − W_n S_n                 (GLA: U_n = values_n)
    S_{n+1} = Diag(decay_n) S_n + k_outᵀ_n U_n

two matrix products per chunk. It returns the state entering every chunk, [N, ..., Dk, Dv], and the
U_n (GDN's "new values"), from which the outputs of all chunks follow in parallel.

    scan(k_out, values, w, decay, state) -> (states, new_values, final_state)

This is the XLA form (`lax.scan`, autodiff through it: its residuals are the states it returns) that
`chunked` runs where the program is lowered for a GPU; chunk_states_pallas.py is the Pallas pass of
the same recurrence, reading the [B, T, H, D] layout in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linjax.kernels import scaling


def scan(k_out, values, w, decay, state):
    """k_out [N, ..., C, Dk], values [N, ..., C, Dv], w like k_out or None, decay [N, ..., Dg] or None,
    state [..., Dk, Dv] (all fp32). Returns (states [N, ..., Dk, Dv] entering each chunk, new values
    [N, ..., C, Dv] (the values themselves when w is None), final state)."""

    def one_chunk(S, x):
        k_out, values, w, decay = x
        u = values if w is None else values - w @ S
        S_next = S if decay is None else scaling.scale_rows(decay, S)
        return S_next + jnp.swapaxes(k_out, -1, -2) @ u, (S, u)

    final, (states, new_values) = jax.lax.scan(one_chunk, state, (k_out, values, w, decay))
    return states, new_values, final
