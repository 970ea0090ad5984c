"""K2 of the chunked Pallas kernels (chunk_pallas.py): the only sequential work, the state carried from
chunk to chunk, and its reverse for the backward.

Forward, per chunk n (chunk_intra_pallas.py gives k̃, W, Ũ and γ; GLA's new values are V itself):

    states[n] = S;   U_n = Ũ_n − W_n S  (the delta rule; else U_n = V_n);   S ← Diag(γ_n) S + k̃_nᵀ U_n

Reverse, with dS = ∂L/∂S_{n+1} carried from the last chunk to the first (chunk_output_pallas.py's
o_n = q̃_n S_n + A^{qk}_n U_n gives the terms in dO):

    d_states[n] = dS;   dU_n = A^{qk}_nᵀ dO_n + k̃_n dS;   dS ← Diag(γ_n) dS + q̃_nᵀ dO_n − W_nᵀ dU_n

One program per (block of value columns, batch × head): value columns are independent, so the state
[Dk, BV] stays in registers in fp32 through a loop over the chunks (not unrolled: the kernel's size does
not depend on T), held as row blocks of at most 64 keys so that each dot reads a [C, 64] tile of k̃ or W;
the block width is chosen so the grid fills the card (pallas_common.value_block).
Dot operands are in the model's dtype with fp32 accumulation; the states and U are stored in that dtype.
Every array is read in its [B, T, H, D] layout; GLA's values through the query head's kv head.

    forward_states(k_gated, values, w, gamma, state, *, chunk, dtype, interpret) -> (states, new_values, final)
    reverse_states(d_out, a_qk, q_gated, k_gated, w, gamma, d_final, *, chunk, dtype, interpret)
        -> (d_states, d_new_values, d_state)
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.pallas_common import F32, Layout, dot, operand_type, t_dot, triton_params, value_block

ROW_BLOCK = 64  # state rows (keys) per piece of the state held in registers


def _row_blocks(key_dim: int):
    size = min(key_dim, ROW_BLOCK)
    return [pl.ds(start, size) for start in range(0, key_dim, size)]


def _decay_rows(gamma_ref, n, rows):
    """Chunk n's decay e^{G_C} for the state rows `rows`, as a column that scales them ([1, 1] for a
    scalar gate)."""
    if gamma_ref.shape[1] == 1:
        return gamma_ref[pl.ds(n, 1), :].astype(F32)
    return gamma_ref[pl.ds(n, 1), rows].astype(F32).T


def _forward_kernel(*refs, delta: bool, gated: bool, n_chunks: int, chunk: int, dtype):
    it = iter(refs)
    kg_ref, values_ref = next(it), next(it)
    w_ref = next(it) if delta else None
    gamma_ref = next(it) if gated else None
    state_ref, states_ref = next(it), next(it)
    u_ref = next(it) if delta else None
    final_ref = next(it)
    blocks = _row_blocks(kg_ref.shape[1])

    def one_chunk(n, S):                                      # S: row blocks of the state entering chunk n
        span = pl.ds(n * chunk, chunk)
        u = values_ref[span, :].astype(F32)
        for rows, part in zip(blocks, S):
            states_ref[n, rows, :] = part.astype(states_ref.dtype)
            if delta:
                u = u - dot(w_ref[span, rows], part, dtype)
        if delta:
            u_ref[span, :] = u.astype(u_ref.dtype)
        if gated:
            S = [_decay_rows(gamma_ref, n, rows) * part for rows, part in zip(blocks, S)]
        return tuple(part + t_dot(kg_ref[span, rows], u, dtype) for rows, part in zip(blocks, S))

    final = lax.fori_loop(0, n_chunks, one_chunk, tuple(state_ref[rows, :].astype(F32) for rows in blocks))
    for rows, part in zip(blocks, final):
        final_ref[rows, :] = part


def forward_states(k_gated, values, w, gamma, state, *, chunk: int, dtype, interpret: bool):
    """k_gated [B,T,H,Dk]; values [B,T,H,Dv] (Ũ, with w) or [B,T,Hkv,Dv] (GLA's V); w [B,T,H,Dk] or None;
    gamma [B,N,H,Dg] or None; state [B,H,Dk,Dv] fp32. Returns (states [B,N,H,Dk,Dv] entering each chunk,
    in `dtype`; U [B,T,H,Dv] in `dtype` (the delta rule; else the values themselves); final state fp32)."""
    B, T, H, Dk = k_gated.shape
    Dv = values.shape[-1]
    N = T // chunk
    delta, gated = w is not None, gamma is not None
    BV = value_block(Dv, B * H, dtype)
    layout = Layout(H, values.shape[2], chunk)
    seq = functools.partial(layout.whole_sequence, T, axes="jb")
    inputs, in_specs = [k_gated, values], [seq(Dk), seq(Dv, kv=not delta, col_block=BV)]
    if delta:
        inputs.append(w)
        in_specs.append(seq(Dk))
    if gated:
        inputs.append(gamma)
        in_specs.append(layout.per_chunk(gamma.shape[-1], axes="jb", all_chunks=True, n_chunks=N))
    inputs.append(state)
    in_specs.append(layout.per_head(Dk, Dv, axes="jb", col_block=BV))
    out_shape = [jax.ShapeDtypeStruct((B, N, H, Dk, Dv), dtype)]
    out_specs = [layout.per_chunk(Dk, Dv, axes="jb", all_chunks=True, col_block=BV, n_chunks=N)]
    if delta:
        out_shape.append(jax.ShapeDtypeStruct((B, T, H, Dv), dtype))
        out_specs.append(seq(Dv, col_block=BV))
    out_shape.append(jax.ShapeDtypeStruct((B, H, Dk, Dv), F32))
    out_specs.append(layout.per_head(Dk, Dv, axes="jb", col_block=BV))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, delta=delta, gated=gated, n_chunks=N, chunk=chunk,
                          dtype=operand_type(dtype, interpret)),
        out_shape=out_shape, grid=(Dv // BV, B * H), in_specs=in_specs, out_specs=out_specs,
        compiler_params=triton_params(), interpret=interpret, name="linjax_chunk_states_fwd",
    )(*inputs)
    states, final = out[0], out[-1]
    return states, (out[1] if delta else values), final


def _reverse_kernel(*refs, delta: bool, gated: bool, n_chunks: int, chunk: int, dtype):
    it = iter(refs)
    do_ref, a_ref, qg_ref, kg_ref = next(it), next(it), next(it), next(it)
    w_ref = next(it) if delta else None
    gamma_ref = next(it) if gated else None
    d_final_ref, d_states_ref, du_ref, d_state_ref = next(it), next(it), next(it), next(it)
    blocks = _row_blocks(kg_ref.shape[1])

    def one_chunk(i, dS):                                     # dS: row blocks of ∂L/∂S_{n+1}, fp32
        n = n_chunks - 1 - i
        span = pl.ds(n * chunk, chunk)
        do = do_ref[span, :]
        du = t_dot(a_ref[span, :], do, dtype)
        for rows, part in zip(blocks, dS):
            d_states_ref[n, rows, :] = part.astype(d_states_ref.dtype)
            du = du + dot(kg_ref[span, rows], part, dtype)
        du_ref[span, :] = du
        if gated:
            dS = [_decay_rows(gamma_ref, n, rows) * part for rows, part in zip(blocks, dS)]
        dS = [part + t_dot(qg_ref[span, rows], do, dtype) for rows, part in zip(blocks, dS)]
        if delta:
            dS = [part - t_dot(w_ref[span, rows], du, dtype) for rows, part in zip(blocks, dS)]
        return tuple(dS)

    d_state = lax.fori_loop(0, n_chunks, one_chunk, tuple(d_final_ref[rows, :].astype(F32) for rows in blocks))
    for rows, part in zip(blocks, d_state):
        d_state_ref[rows, :] = part


def reverse_states(d_out, a_qk, q_gated, k_gated, w, gamma, d_final, *, chunk: int, dtype, interpret: bool):
    """d_out [B,T,H,Dv]; a_qk [B,T,H,C]; q_gated, k_gated (and w, the delta rule) [B,T,H,Dk]; gamma
    [B,N,H,Dg] or None; d_final [B,H,Dk,Dv]. Returns (d_states [B,N,H,Dk,Dv] = ∂L/∂S_{n+1} in `dtype`,
    dU [B,T,H,Dv] fp32 (GLA: ∂L/∂V per query head; the delta rule: ∂L/∂Ũ), ∂L/∂initial state fp32)."""
    B, T, H, Dk = k_gated.shape
    Dv = d_out.shape[-1]
    N = T // chunk
    delta, gated = w is not None, gamma is not None
    BV = value_block(Dv, B * H, dtype)
    layout = Layout(H, H, chunk)
    seq = functools.partial(layout.whole_sequence, T, axes="jb")
    inputs = [d_out.astype(dtype), a_qk, q_gated, k_gated] + ([w] if delta else [])
    in_specs = [seq(Dv, col_block=BV), seq(chunk), seq(Dk), seq(Dk)] + ([seq(Dk)] if delta else [])
    if gated:
        inputs.append(gamma)
        in_specs.append(layout.per_chunk(gamma.shape[-1], axes="jb", all_chunks=True, n_chunks=N))
    inputs.append(d_final)
    in_specs.append(layout.per_head(Dk, Dv, axes="jb", col_block=BV))
    out_shape = [jax.ShapeDtypeStruct((B, N, H, Dk, Dv), dtype), jax.ShapeDtypeStruct((B, T, H, Dv), F32),
                 jax.ShapeDtypeStruct((B, H, Dk, Dv), F32)]
    out_specs = [layout.per_chunk(Dk, Dv, axes="jb", all_chunks=True, col_block=BV, n_chunks=N),
                 seq(Dv, col_block=BV), layout.per_head(Dk, Dv, axes="jb", col_block=BV)]
    return pl.pallas_call(
        functools.partial(_reverse_kernel, delta=delta, gated=gated, n_chunks=N, chunk=chunk,
                          dtype=operand_type(dtype, interpret)),
        out_shape=out_shape, grid=(Dv // BV, B * H), in_specs=in_specs, out_specs=out_specs,
        compiler_params=triton_params(), interpret=interpret, name="linjax_chunk_states_bwd",
    )(*inputs)
