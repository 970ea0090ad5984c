"""The chunked linear-attention kernels in FLA's decomposition, forward and backward in Pallas (Triton).

One function serves every linear mechanism here: GLA and kGLA (an additive state with a per-channel
decay), the delta rule with a per-channel or scalar decay (GDN), and no decay at all (Hedgehog's linear
attention). With the state S [Dk, Dv] entering chunk n:

    forward    K1 chunk_intra_pallas     every chunk at once: scores A^{qk}, q̃, k̃, γ (and W, Ũ, T⁻¹)
               K2 chunk_states_pallas    the one sequential pass: the states entering each chunk, U
               K3 chunk_output_pallas    every chunk at once: o = q̃ S_n + A^{qk} U
    backward   chunk_states_pallas       the reverse pass: ∂L/∂S_{n+1} and ∂L/∂U per chunk
               chunk_grads_pallas        every chunk at once: through o and S', the WY solve, the scores
                                         and the decays
    plus a few elementwise XLA operations: the sub-chunk cumulative gates (chunk_gates.py) and, in the
    backward, the gate gradient's sum over each chunk and the sum of key and value gradients over the
    query heads that share a kv head.

The forward keeps what the backward reads (scores, gated q and k, states, U, T⁻¹, A^{kk}); a training step
that recomputes each layer (train.remat = "full") holds them for one layer at a time.

    chunk_attention(q, k, v, log_gate, beta, initial_state, *, scale, chunk, interpret)
        -> (o [B,T,H,Dv] in v's dtype, final state [B,H,Dk,Dv] fp32)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linjax.kernels import chunk_gates
from linjax.kernels.chunk_grads_pallas import score_grads, state_grads, wy_grads
from linjax.kernels.chunk_intra_pallas import intra_chunk
from linjax.kernels.chunk_output_pallas import chunk_outputs
from linjax.kernels.chunk_states_pallas import forward_states, reverse_states
from linjax.kernels.pallas_common import F32, PALLAS_MIN_CHUNK, by_platform, pad_axis, tile_size


def _forward(q, k, v, log_gate, beta, state, *, scale, chunk, dtype, out_dtype, interpret):
    b = None if log_gate is None else chunk_gates.sub_chunk_cumsum(log_gate)
    beta4 = None if beta is None else beta[..., None]
    intra = intra_chunk(q, k, v if beta is not None else None, b, beta4, chunk=chunk, scale=scale, dtype=dtype,
                        interpret=interpret)
    values = intra.u_tilde if beta is not None else v
    states, new_values, final = forward_states(intra.k_gated, values, intra.w, intra.gamma, state, chunk=chunk,
                                               dtype=dtype, interpret=interpret)
    o = chunk_outputs(intra.q_gated, intra.a_qk, states, new_values, chunk=chunk, dtype=dtype, out_dtype=out_dtype,
                      interpret=interpret)
    return (o, final), (b, intra, states, new_values)


def _sum_over_groups(x, kv_heads: int):
    """[B, T, H, D] per query head -> [B, T, Hkv, D]: the heads sharing a kv head summed."""
    B, T, H, D = x.shape
    return x.reshape(B, T, kv_heads, H // kv_heads, D).sum(3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _chunk_attention(q, k, v, log_gate, beta, state, scale, chunk, out_dtype, interpret):
    return _forward(q, k, v, log_gate, beta, state, scale=scale, chunk=chunk, dtype=v.dtype, out_dtype=out_dtype,
                    interpret=interpret)[0]


def _chunk_attention_fwd(q, k, v, log_gate, beta, state, scale, chunk, out_dtype, interpret):
    out, (b, intra, states, new_values) = _forward(q, k, v, log_gate, beta, state, scale=scale, chunk=chunk,
                                                   dtype=v.dtype, out_dtype=out_dtype, interpret=interpret)
    # Ũ is read by the forward only (the backward goes through U = Ũ − W S): not kept.
    return out, (q, k, v, log_gate, beta, b, intra._replace(u_tilde=None), states, new_values)


def _chunk_attention_bwd(scale, chunk, out_dtype, interpret, saved, cotangents):
    q, k, v, log_gate, beta, b, intra, states, new_values = saved
    d_out, d_final = cotangents
    dtype = v.dtype
    delta = beta is not None
    Hkv = k.shape[2]
    d_states, d_u, d_state = reverse_states(d_out, intra.a_qk, intra.q_gated, intra.k_gated, intra.w, intra.gamma,
                                            d_final.astype(F32), chunk=chunk, dtype=dtype, interpret=interpret)
    d_qg, d_kg, d_a, d_end, d_w = state_grads(d_out, states, d_states, new_values, d_u if delta else None,
                                              intra.k_gated, intra.gamma, chunk=chunk, dtype=dtype,
                                              interpret=interpret)
    if delta:
        d_akk, d_v, dk_wy, dg_wy, d_beta = wy_grads(k, v, b, beta[..., None], intra.inverse, intra.a_kk, d_w, d_u,
                                                    chunk=chunk, dtype=dtype, interpret=interpret)
    else:
        d_akk = dk_wy = dg_wy = d_beta = None
        d_v = d_u
    d_q, d_k, d_cumulative = score_grads(q, k, b, d_a, d_qg, d_kg, d_end, d_akk, dk_wy, dg_wy, chunk=chunk,
                                         scale=scale, dtype=dtype, interpret=interpret)
    d_gate = None if log_gate is None else chunk_gates.gate_gradient(d_cumulative, chunk).astype(log_gate.dtype)
    return (d_q.astype(q.dtype), _sum_over_groups(d_k, Hkv).astype(k.dtype), _sum_over_groups(d_v, Hkv).astype(v.dtype),
            d_gate, None if beta is None else d_beta[..., 0].astype(beta.dtype), d_state)


_chunk_attention.defvjp(_chunk_attention_fwd, _chunk_attention_bwd)


def chunk_attention(q, k, v, log_gate, beta, initial_state, *, scale: float, chunk: int, out_dtype=None,
                    interpret=None):
    """q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv] (dot operands in v's dtype); log_gate [B,T,H,Dg] fp32
    (Dg = Dk per channel, or 1: a scalar per head) or None for no decay; beta [B,T,H] fp32 for the delta
    rule, None for the additive rule; initial_state [B,H,Dk,Dv] fp32. `chunk` a power of two ≥ 16 (a
    shorter input uses the smallest chunk that holds it). `out_dtype` (default v's) is o's dtype.
    interpret=None: compiled by Triton where the program is lowered for a GPU, interpreted on a CPU.
    Returns (o [B,T,H,Dv], final state [B,H,Dk,Dv] fp32)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk, max(PALLAS_MIN_CHUNK, 1 << max(T - 1, 0).bit_length()))
    Tp = -(-T // C) * C
    # Head dims padded to Triton tiles of at least 32: at 16, Triton's layouts for the solve spill registers.
    Dkp, Dvp = max(32, tile_size(Dk)), max(32, tile_size(Dv))
    dtype = v.dtype
    pad = lambda x, width: pad_axis(pad_axis(x, 1, Tp), 3, width)                  # noqa: E731
    q, k, v = pad(q, Dkp).astype(dtype), pad(k, Dkp).astype(dtype), pad(v, Dvp)
    if log_gate is not None:
        log_gate = chunk_gates.clamp(log_gate.astype(F32))
        log_gate = pad(log_gate, Dkp if log_gate.shape[-1] == Dk and Dk > 1 else log_gate.shape[-1])
    if beta is not None:
        beta = pad_axis(beta.astype(F32), 1, Tp)
    state = pad_axis(pad_axis(initial_state.astype(F32), 2, Dkp), 3, Dvp)
    arrays = [x for x in (q, k, v, log_gate, beta, state) if x is not None]
    present = [x is not None for x in (q, k, v, log_gate, beta, state)]

    def run(*given, interpret):
        it = iter(given)
        args = [next(it) if p else None for p in present]
        return _chunk_attention(*args, float(scale), C, jnp.dtype(out_dtype or dtype), interpret)

    o, final = by_platform(run, *arrays, interpret=interpret)
    return o[:, :T, :, :Dv], final[:, :, :Dk, :Dv]
