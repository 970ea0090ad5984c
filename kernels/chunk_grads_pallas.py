"""The parallel part of the chunked Pallas kernels' backward (chunk_pallas.py): after the reverse state
pass (chunk_states_pallas.py) has given ∂L/∂S_{n+1} and ∂L/∂U_n for every chunk, everything else is
independent per chunk. Three kernels:

state_grads   per (chunk, batch × head), from o = q̃ S + A^{qk} U and S' = Diag(γ) S + k̃ᵀ U (U = Ũ − W S):
                  ∂q̃ = dO Sᵀ,  ∂A^{qk} = dO Uᵀ (j ≤ i),  ∂k̃ = U dS'ᵀ,  ∂W = −dU Sᵀ,
                  ∂L/∂G_C (direct) = Σ_j ∂k̃_j ⊙ k̃_j + (Σ_v S ⊙ dS') ⊙ γ
wy_grads      per (chunk, batch × head), the delta rule's WY step: W = M Diag(β)(K ⊙ Γ), Ũ = M Diag(β) V,
              M = T⁻¹, T = I + Diag(β) A^{kk}:
                  ∂M = dŨ (βV)ᵀ + dW (βK⊙Γ)ᵀ,  ∂T = −Mᵀ ∂M Mᵀ,  ∂A^{kk} = Diag(β) ∂T (j < i),
                  ∂V = β Mᵀ dŨ,  ∂K = β (Mᵀ dW) ⊙ Γ,  ∂G = β (Mᵀ dW) ⊙ K ⊙ Γ,
                  ∂β = rows of (Mᵀ dŨ ⊙ V + Mᵀ dW ⊙ K ⊙ Γ) + rows of (∂T ⊙ A^{kk})
score_grads   per (chunk, batch × head, sub-chunk of 16 rows), through the scores and the decays: for
              A = Σ_d x_i y_j e^{G_i − G_j},
                  ∂x_i = Σ_j ∂A_ij y_j e^{G_i − G_j},  ∂y_j = Σ_i ∂A_ij x_i e^{G_i − G_j},
                  ∂G_i += x_i ⊙ ∂x_i,  ∂G_j −= y_j ⊙ ∂y_j;
              and q̃ = scale Q ⊙ e^{G}, k̃ = K ⊙ e^{G_C − G} elementwise. The diagonal 16 × 16 block goes
              column by column (∂x) and row by row (∂y), ∂A's column or row read from the ref: no
              reductions across rows; other blocks are dots through the boundary between their
              sub-chunks, in loops over the sub-chunks (not unrolled).

The result ∂L/∂G_i (G the chunk's cumulative log-decay) becomes ∂L/∂g by a sum over the rest of the
chunk (chunk_gates.gate_gradient); key and value gradients come per query head and are summed over each
kv head's group outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.chunk_intra_pallas import ChunkGates
from linjax.kernels.pallas_common import (
    F32,
    SUB,
    Layout,
    cols,
    column_loop,
    dot,
    dot_t,
    operand_type,
    rows,
    t_dot,
    triton_params,
)

KEY_BLOCK = 64  # keys per program of state_grads


# --------------------------------------------------------------------------------- state side


def _state_kernel(*refs, delta: bool, gated: bool, scalar_gate: bool, dtype, chunk: int):
    it = iter(refs)
    do_ref, s_ref, ds_ref, u_ref = next(it), next(it), next(it), next(it)   # s_ref, ds_ref: this key block
    du_ref = next(it) if delta else None
    kg_ref, gamma_ref = (next(it), next(it)) if gated else (None, None)
    dqg_ref, dkg_ref, da_ref = next(it), next(it), next(it)
    dend_ref = next(it) if gated else None
    dw_ref = next(it) if delta else None
    rows_k = s_ref.shape[0]

    def value_block(columns, carry):
        d_qg, d_kg, d_w, d_gamma = carry
        u = u_ref[:, columns]
        S, dS = s_ref[:, columns], ds_ref[:, columns]
        d_qg = d_qg + dot_t(do_ref[:, columns], S, dtype)
        d_kg = d_kg + dot_t(u, dS, dtype)
        if delta:
            d_w = d_w - dot_t(du_ref[:, columns], S, dtype)
        if gated:
            d_gamma = d_gamma + jnp.sum(S.astype(F32) * dS.astype(F32), axis=1, keepdims=True)
        return d_qg, d_kg, d_w, d_gamma

    tile = jnp.zeros((chunk, rows_k), F32)
    d_qg, d_kg, d_w, d_gamma = column_loop(s_ref.shape[1], value_block,
                                           (tile, tile, tile, jnp.zeros((rows_k, 1), F32)), dtype)
    dqg_ref[...] = d_qg
    dkg_ref[...] = d_kg
    if delta:
        dw_ref[...] = d_w
    if gated:  # this key block's part of ∂L/∂G_C: Σ_j ∂k̃_j ⊙ k̃_j + ∂γ ⊙ γ
        end = jnp.sum(d_kg * kg_ref[...].astype(F32), axis=0, keepdims=True)   # [1, rows_k]
        d_gamma = d_gamma.T
        if scalar_gate:  # one γ for every key: this block's share, summed over the blocks outside
            end = jnp.sum(end, axis=1, keepdims=True) + \
                jnp.sum(d_gamma, axis=1, keepdims=True) * gamma_ref[...].astype(F32).reshape(1, 1)
        else:
            end = end + d_gamma * gamma_ref[...].astype(F32).reshape(1, -1)
        dend_ref[...] = end.reshape(dend_ref.shape)

    @pl.when(pl.program_id(2) == 0)
    def _():  # ∂A^{qk} = dO Uᵀ, once per chunk
        def value_block_scores(columns, acc):
            return acc + dot_t(do_ref[:, columns], u_ref[:, columns], dtype)

        d_a = column_loop(s_ref.shape[1], value_block_scores, jnp.zeros((chunk, chunk), F32), dtype)
        da_ref[...] = jnp.where(rows(chunk) >= cols(chunk), d_a, 0.0)


def state_grads(d_out, states, d_states, new_values, d_new_values, k_gated, gamma, *, chunk: int, dtype,
                interpret: bool):
    """d_out [B,T,H,Dv]; states, d_states [B,N,H,Dk,Dv]; new_values [B,T,H or Hkv,Dv] (U, or GLA's V);
    d_new_values [B,T,H,Dv] fp32 (the delta rule; else None); k_gated [B,T,H,Dk] and gamma [B,N,H,Dg]
    (None: no gate). Returns (∂q̃, ∂k̃ [B,T,H,Dk], ∂A^{qk} [B,T,H,C], ∂L/∂G_C [B,N,H,Dg] or None,
    ∂W [B,T,H,Dk] or None), fp32. One program per (chunk, batch × head, block of 64 keys)."""
    B, T, H, Dv = d_out.shape
    Dk = states.shape[3]
    N = T // chunk
    KB = min(Dk, KEY_BLOCK)
    n_key_blocks = Dk // KB
    delta, gated = d_new_values is not None, gamma is not None
    scalar_gate = gated and gamma.shape[-1] == 1
    layout = Layout(H, new_values.shape[2], chunk)
    on = functools.partial(layout.tokens, axes="nbj")
    keys = functools.partial(layout.tokens, axes="nbj", col_block=KB)
    key_rows = pl.BlockSpec((None, None, None, KB, Dv), lambda n, bh, j: (bh // H, n, bh % H, j, 0))
    inputs = [d_out.astype(dtype), states, d_states, new_values]
    in_specs = [on(Dv), key_rows, key_rows, on(Dv, kv=new_values.shape[2] != H)]
    if delta:
        inputs.append(d_new_values)
        in_specs.append(on(Dv))
    if gated:
        inputs += [k_gated, gamma]
        in_specs += [keys(Dk), layout.per_chunk(gamma.shape[-1], axes="nbj", col_block=None if scalar_gate else KB)]
    # A scalar gate's ∂L/∂G_C comes per key block and is summed below.
    end_width = n_key_blocks if scalar_gate else Dk
    shapes = [((B, T, H, Dk), keys(Dk)), ((B, T, H, Dk), keys(Dk)), ((B, T, H, chunk), on(chunk))]
    if gated:
        end_spec = layout.per_chunk(end_width, axes="nbj", col_block=1 if scalar_gate else KB)
        shapes.append(((B, N, H, end_width), end_spec))
    if delta:
        shapes.append(((B, T, H, Dk), keys(Dk)))
    out = pl.pallas_call(
        functools.partial(_state_kernel, delta=delta, gated=gated, scalar_gate=scalar_gate,
                          dtype=operand_type(dtype, interpret), chunk=chunk),
        out_shape=[jax.ShapeDtypeStruct(shape, F32) for shape, _ in shapes], grid=(N, B * H, n_key_blocks),
        in_specs=in_specs, out_specs=[spec for _, spec in shapes], compiler_params=triton_params(num_warps=8),
        interpret=interpret, name="linjax_chunk_state_grads",
    )(*inputs)
    d_qg, d_kg, d_a = out[:3]
    d_end = out[3] if gated else None
    if scalar_gate:
        d_end = d_end.sum(-1, keepdims=True)
    d_w = out[-1] if delta else None
    return d_qg, d_kg, d_a, d_end, d_w


# --------------------------------------------------------------------------------- WY (delta rule)


def _wy_kernel(k_ref, v_ref, b_ref, beta_ref, m_ref, akk_ref, dw_ref, du_ref,
               dakk_ref, dv_ref, dk_ref, dg_ref, dbeta_ref, *, n_sub: int, dtype, exact):
    C = n_sub * SUB
    gates = ChunkGates(b_ref, n_sub)
    scalar_gate = b_ref.shape[1] == 1
    gate_columns = (lambda columns: pl.ds(0, 1)) if scalar_gate else (lambda columns: columns)
    beta = beta_ref[...].astype(F32)                            # [C, 1]
    M = m_ref[...]

    def from_values(columns, d_m):
        return d_m + dot_t(du_ref[:, columns], beta * v_ref[:, columns].astype(F32), dtype)

    def from_keys(columns, d_m):
        gamma = jnp.exp(gates.from_start(gate_columns(columns)))
        return d_m + dot_t(dw_ref[:, columns], beta * k_ref[:, columns].astype(F32) * gamma, dtype)

    d_m = column_loop(v_ref.shape[1], from_values, jnp.zeros((C, C), F32), dtype)
    d_m = column_loop(k_ref.shape[1], from_keys, d_m, dtype)
    d_t = -dot_t(t_dot(M, jnp.where(rows(C) >= cols(C), d_m, 0.0), exact), M, exact)   # −Mᵀ ∂M Mᵀ
    strictly_lower = rows(C) > cols(C)
    dakk_ref[...] = jnp.where(strictly_lower, beta * d_t, 0.0)
    d_beta = jnp.sum(jnp.where(strictly_lower, d_t * akk_ref[...], 0.0), axis=1, keepdims=True)

    def value_grads(columns, d_beta):
        d_bv = t_dot(M, du_ref[:, columns], dtype)
        dv_ref[:, columns] = beta * d_bv
        return d_beta + jnp.sum(d_bv * v_ref[:, columns].astype(F32), axis=1, keepdims=True)

    def key_grads(columns, d_beta):
        gamma = jnp.exp(gates.from_start(gate_columns(columns)))
        d_bk = t_dot(M, dw_ref[:, columns], dtype)
        weighted = d_bk * k_ref[:, columns].astype(F32) * gamma
        dk_ref[:, columns] = beta * d_bk * gamma
        dg_ref[:, columns] = beta * weighted
        return d_beta + jnp.sum(weighted, axis=1, keepdims=True)

    d_beta = column_loop(v_ref.shape[1], value_grads, d_beta, dtype)
    dbeta_ref[...] = column_loop(k_ref.shape[1], key_grads, d_beta, dtype)


def wy_grads(k, v, b, beta, inverse, a_kk, d_w, d_u_tilde, *, chunk: int, dtype, interpret: bool):
    """The delta rule's WY backward. k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], b [B,T,H,Dg], beta [B,T,H,1],
    inverse and a_kk [B,T,H,C] fp32, d_w [B,T,H,Dk] and d_u_tilde [B,T,H,Dv] fp32. Returns (∂A^{kk} with
    β folded in [B,T,H,C], ∂V [B,T,H,Dv] per query head, ∂K, ∂G [B,T,H,Dk] per query head, ∂β [B,T,H,1])."""
    B, T, H, Dk = d_w.shape
    Dv = v.shape[-1]
    N = T // chunk
    layout = Layout(H, k.shape[2], chunk)
    on = functools.partial(layout.tokens, axes="nb")
    out_shapes = [(chunk, (B, T, H, chunk)), (Dv, (B, T, H, Dv)), (Dk, (B, T, H, Dk)), (Dk, (B, T, H, Dk)),
                  (1, (B, T, H, 1))]
    return pl.pallas_call(
        functools.partial(_wy_kernel, n_sub=chunk // SUB, dtype=operand_type(dtype, interpret),
                          exact=operand_type(F32, interpret)),
        out_shape=[jax.ShapeDtypeStruct(shape, F32) for _, shape in out_shapes], grid=(N, B * H),
        in_specs=[on(Dk, kv=True), on(Dv, kv=True), on(b.shape[-1]), on(1), on(chunk), on(chunk), on(Dk), on(Dv)],
        out_specs=[on(width) for width, _ in out_shapes], compiler_params=triton_params(num_warps=8),
        interpret=interpret, name="linjax_chunk_wy_grads",
    )(k, v, b, beta, inverse, a_kk, d_w, d_u_tilde)


# --------------------------------------------------------------------------------- scores and decays


def _diagonal_row_side(d_ref, start, x_rows_b, y_ref, b_ref, strict: bool):
    """Σ_j ∂A_ij y_j e^{b_i − b_j} over the diagonal block (j ≤ i, or j < i if strict) of the sub-chunk
    at `start`: column j of ∂A (d_ref holds the sub-chunk's rows) and row j of y, b read from the refs.
    x_rows_b: the sub-chunk's cumulative gates [16, Dg], or None (no gate)."""
    r = rows(SUB)

    def column(j, acc):
        d_col = d_ref[:, pl.ds(start + j, 1)].astype(F32)                        # [16, 1]
        y = y_ref[pl.ds(start + j, 1), :].astype(F32)                            # [1, D]
        if x_rows_b is not None:
            y = y * jnp.exp(jnp.minimum(x_rows_b - b_ref[pl.ds(start + j, 1), :].astype(F32), 0.0))
        keep = (r > j) if strict else (r >= j)
        return acc + jnp.where(keep, d_col * y, 0.0)

    return lax.fori_loop(0, SUB, column, jnp.zeros((SUB, y_ref.shape[1]), F32))


def _diagonal_column_side(d_ref, start, y_rows_b, x_ref, b_ref, strict: bool):
    """Σ_i ∂A_ij x_i e^{b_i − b_j} over the diagonal block (i ≥ j, or i > j if strict) of the sub-chunk at
    `start`, for its rows j: row i of ∂A (d_ref holds the whole chunk's rows) and of x, b from the refs."""
    r = rows(SUB)

    def row(i, acc):
        d_row = d_ref[pl.ds(start + i, 1), pl.ds(start, SUB)].astype(F32).T     # [16, 1]: ∂A_ij over j
        x = x_ref[pl.ds(start + i, 1), :].astype(F32)                            # [1, D]
        if y_rows_b is not None:
            x = x * jnp.exp(jnp.minimum(b_ref[pl.ds(start + i, 1), :].astype(F32) - y_rows_b, 0.0))
        keep = (r < i) if strict else (r <= i)
        return acc + jnp.where(keep, d_row * x, 0.0)

    return lax.fori_loop(0, SUB, row, jnp.zeros((SUB, x_ref.shape[1]), F32))


def _score_kernel(*refs, delta: bool, gated: bool, scalar_gate: bool, n_sub: int, scale: float, dtype):
    it = iter(refs)
    q_ref, k_ref = next(it), next(it)                     # the whole chunk
    b_ref = next(it) if gated else None                   # the whole chunk
    da_rows_ref, da_ref, dqg_ref, dkg_ref = next(it), next(it), next(it), next(it)  # rows: the sub-chunk's
    dend_ref = next(it) if gated else None
    if delta:
        dakk_rows_ref, dakk_ref, dkwy_ref, dgwy_ref = next(it), next(it), next(it), next(it)
    dq_ref, dk_ref = next(it), next(it)
    dcum_ref = next(it) if gated else None
    s = pl.program_id(2)
    start = s * SUB
    gates = ChunkGates(b_ref, n_sub) if gated else None
    q = q_ref[pl.ds(start, SUB), :].astype(F32)
    k = k_ref[pl.ds(start, SUB), :].astype(F32)
    b = b_ref[pl.ds(start, SUB), :].astype(F32) if gated else None
    d_qg, d_kg = dqg_ref[...], dkg_ref[...]
    # q̃ = scale · q ⊙ Γ and k̃ = k ⊙ e^{G_C − G}.
    if gated:
        from_start = jnp.exp(b + gates.before(s))
        to_end = jnp.exp(gates.total(s) - b + gates.after(s))
        dq = scale * d_qg * from_start
        dk = d_kg * to_end
        d_cum = scale * d_qg * q * from_start - d_kg * k * to_end
    else:
        dq, dk, d_cum = scale * d_qg, d_kg, None
    if delta:
        dk = dk + dkwy_ref[...]
        d_cum = d_cum + dgwy_ref[...]
    width = b_ref.shape[1] if gated else 1

    # Row side: Σ_j over the blocks to the left and the diagonal (∂A^{qk} → ∂q; ∂A^{kk} → ∂k).
    def left_block(step, carry):                          # sub-chunk t = s − 1 − step
        dq_left, dk_left, crossed = carry
        t = s - 1 - step
        key = k_ref[pl.ds(t * SUB, SUB), :].astype(F32)
        if gated:                                         # e^{B_t − b_j + Σ_{t<u<s} B_u}: j to s's start
            total = gates.total(t)
            key = key * jnp.exp(total - b_ref[pl.ds(t * SUB, SUB), :].astype(F32) + crossed)
            crossed = crossed + total
        dq_left = dq_left + dot(da_rows_ref[:, pl.ds(t * SUB, SUB)], key, dtype)
        if delta:
            dk_left = dk_left + dot(dakk_rows_ref[:, pl.ds(t * SUB, SUB)], key, dtype)
        return dq_left, dk_left, crossed

    zeros = jnp.zeros(q.shape, F32)
    dq_left, dk_left, _ = lax.fori_loop(0, s, left_block, (zeros, zeros, jnp.zeros((1, width), F32)))
    if gated:  # from s's start to the rows i: e^{b_i}
        into_rows = jnp.exp(b)
        dq_left, dk_left = dq_left * into_rows, dk_left * into_rows
    dq_scores = _diagonal_row_side(da_rows_ref, start, b, k_ref, b_ref, strict=False) + dq_left
    if delta:
        dk_rows = _diagonal_row_side(dakk_rows_ref, start, b, k_ref, b_ref, strict=True) + dk_left

    # Column side: Σ_i over the blocks below (∂A^{qk} with q, ∂A^{kk} with k) and the diagonal.
    def lower_block(t, carry):                            # sub-chunk t > s, below
        dk_cols, crossed = carry
        rows_t = pl.ds(t * SUB, SUB)
        q_t, k_t = q_ref[rows_t, :].astype(F32), k_ref[rows_t, :].astype(F32)
        if gated:
            into_t = jnp.exp(b_ref[rows_t, :].astype(F32) + crossed)            # e^{b_i + Σ_{s<u<t} B_u}
            q_t, k_t = q_t * into_t, k_t * into_t
            crossed = crossed + gates.total(t)
        part = scale * t_dot(da_ref[rows_t, pl.ds(start, SUB)], q_t, dtype)
        if delta:
            part = part + t_dot(dakk_ref[rows_t, pl.ds(start, SUB)], k_t, dtype)
        return dk_cols + part, crossed

    dk_lower, _ = lax.fori_loop(s + 1, n_sub, lower_block, (zeros, jnp.zeros((1, width), F32)))
    if gated:  # from the rows j to their sub-chunk's end: e^{B_s − b_j}
        dk_lower = dk_lower * jnp.exp(gates.total(s) - b)
    dk_cols = scale * _diagonal_column_side(da_ref, start, b, q_ref, b_ref, strict=False) + dk_lower
    if delta:
        dk_cols = dk_cols + _diagonal_column_side(dakk_ref, start, b, k_ref, b_ref, strict=True)
    dq_ref[...] = dq + scale * dq_scores
    dk_ref[...] = dk + dk_cols + (dk_rows if delta else 0.0)
    if gated:
        d_cum = d_cum + scale * q * dq_scores - k * dk_cols
        if delta:
            d_cum = d_cum + k * dk_rows
        if scalar_gate:
            d_cum = jnp.sum(d_cum, axis=1, keepdims=True)
        # G_C is the chunk's last G: k̃ and γ depend on it directly.
        last_row = (rows(SUB) == SUB - 1) & (s == n_sub - 1)
        d_cum = jnp.where(last_row, d_cum + dend_ref[...].astype(F32).reshape(1, -1), d_cum)
        dcum_ref[...] = d_cum


def score_grads(q, k, b, d_a, d_qg, d_kg, d_end, d_akk, dk_wy, dg_wy, *, chunk: int, scale: float, dtype,
                interpret: bool):
    """q [B,T,H,Dk], k [B,T,Hkv,Dk], b [B,T,H,Dg] or None; ∂A^{qk} [B,T,H,C]; ∂q̃, ∂k̃ [B,T,H,Dk];
    ∂L/∂G_C [B,N,H,Dg] or None; the delta rule's ∂A^{kk} [B,T,H,C] and WY parts ∂K, ∂G [B,T,H,Dk] (else
    None). Returns (∂q, ∂k per query head [B,T,H,Dk], ∂G [B,T,H,Dg] or None), fp32."""
    B, T, H, Dk = q.shape
    N = T // chunk
    delta, gated = d_akk is not None, b is not None
    layout = Layout(H, k.shape[2], chunk)
    rows_of = functools.partial(layout.sub_chunk, axes="nbs")
    chunk_of = functools.partial(layout.tokens, axes="nbs")
    inputs, in_specs = [q, k], [chunk_of(Dk), chunk_of(Dk, kv=True)]
    if gated:
        inputs.append(b)
        in_specs.append(chunk_of(b.shape[-1]))
    inputs += [d_a, d_a, d_qg, d_kg]
    in_specs += [rows_of(chunk), chunk_of(chunk), rows_of(Dk), rows_of(Dk)]
    if gated:
        inputs.append(d_end)
        in_specs.append(layout.per_chunk(d_end.shape[-1], axes="nbs"))
    if delta:
        inputs += [d_akk, d_akk, dk_wy, dg_wy]
        in_specs += [rows_of(chunk), chunk_of(chunk), rows_of(Dk), rows_of(Dk)]
    shapes = [(Dk, (B, T, H, Dk)), (Dk, (B, T, H, Dk))] + ([(b.shape[-1], (B, T, H, b.shape[-1]))] if gated else [])
    out = pl.pallas_call(
        functools.partial(_score_kernel, delta=delta, gated=gated, scalar_gate=gated and b.shape[-1] == 1,
                          n_sub=chunk // SUB, scale=scale, dtype=operand_type(dtype, interpret)),
        out_shape=[jax.ShapeDtypeStruct(shape, F32) for _, shape in shapes], grid=(N, B * H, chunk // SUB),
        in_specs=in_specs, out_specs=[rows_of(width) for width, _ in shapes],
        compiler_params=triton_params(num_warps=8),
        interpret=interpret, name="linjax_chunk_score_grads",
    )(*inputs)
    return out[0], out[1], (out[2] if gated else None)
