"""K1 of the chunked Pallas kernels (chunk_pallas.py): everything inside a chunk that needs no state, for
every chunk in parallel.

For a chunk of C tokens (chunk_gates.py has the decays; gdn.py the delta rule's equations):

    A^{qk}_ij = scale · Σ_d q_id k_jd e^{G_id − G_jd}   (j ≤ i; 0 above the diagonal)
    q̃ = scale · Q ⊙ Γ,   k̃ = K ⊙ e^{G_C − G},   γ = e^{G_C}       (Γ_i = e^{G_i}, from the chunk start)
and for the delta rule also
    A^{kk}_ij = Σ_d k_id k_jd e^{G_id − G_jd}   (j < i),   T = I + Diag(β) A^{kk},   M = T⁻¹
    W = M Diag(β)(K ⊙ Γ),   Ũ = M Diag(β) V

Two kernels, as FLA splits this work:

scores    one program per (chunk, batch × head, sub-chunk of 16 rows): the rows' q̃, k̃ and their row
          block of A^{qk} (and A^{kk}). The diagonal 16 × 16 block goes column by column, a row of k and
          of the cumulative gate read from the refs (exact decays, no row extraction in registers);
          each block to its left is one dot through the boundary between the two sub-chunks, in a loop
          (not unrolled), so few [16, D] tiles are alive at once.
solve_wy  one program per (chunk, batch × head): M by block forward substitution, row block by row
          block, M_s = T_ss⁻¹ (E_s − Σ_{l<s} T_sl M_l), each 16 × 16 T_ss⁻¹ as (I − N)(I + N²)(I + N⁴)(I + N⁸)
          (N its strictly lower part: N¹⁶ = 0), fp32 at full precision; then W and Ũ as M's row blocks
          times Diag(β)(K ⊙ Γ) and Diag(β) V, a block of 64 columns at a time.

Dots of q, k, v take operands in `dtype` (bf16: tensor cores) with fp32 accumulation. Inputs are read
in place: q [B,T,H,Dk], k [B,T,Hkv,Dk] and v [B,T,Hkv,Dv] in their dtype (a query head reads its kv
head: GQA without copies), the sub-chunk cumulative gates b [B,T,H,Dg] (Dg = Dk, or 1 for a scalar
gate) and β [B,T,H,1] in fp32. T is a multiple of C; Dk and Dv are Triton tiles.

    intra_chunk(q, k, v, b, beta, *, chunk, scale, dtype, interpret) -> IntraChunk
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.pallas_common import (
    F32,
    SUB,
    Layout,
    cols,
    column_loop,
    dot,
    dot_t,
    identity,
    operand_type,
    rows,
    triton_params,
)


class IntraChunk(NamedTuple):
    a_qk: jax.Array  # [B, T, H, C]: row t holds A^{qk} of t's chunk, in `dtype` (fp32 if dtype is)
    q_gated: jax.Array  # [B, T, H, Dk] dtype: scale · q ⊙ Γ
    k_gated: jax.Array  # [B, T, H, Dk] dtype: k ⊙ e^{G_C − G}
    gamma: jax.Array | None  # [B, N, H, Dg] fp32: e^{G_C} (None without a gate)
    w: jax.Array | None  # [B, T, H, Dk] dtype (the delta rule)
    u_tilde: jax.Array | None  # [B, T, H, Dv] dtype (the delta rule)
    inverse: jax.Array | None  # [B, T, H, C] fp32: M = T⁻¹ (the delta rule)
    a_kk: jax.Array | None  # [B, T, H, C] fp32: A^{kk}, strictly lower (the delta rule)


# ------------------------------------------------------------------------------ gate sums


class ChunkGates:
    """The sub-chunk totals B_u (the cumulative gate at each sub-chunk's last row, [1, Dg]) of one chunk,
    and the sums of log-decays that cross whole sub-chunks. Every sum adds non-positive terms (no
    cancellation), so e^{sum} is as exact as a product of the factors."""

    def __init__(self, b_ref, n_sub: int):
        self.b_ref = b_ref
        self.n_sub = n_sub
        self.totals = [b_ref[pl.ds(u * SUB + SUB - 1, 1), :].astype(F32) for u in range(n_sub)]

    def total(self, s):
        """B_s for a sub-chunk index known only at run time."""
        return self.b_ref[pl.ds(s * SUB + SUB - 1, 1), :].astype(F32)

    def before(self, s):
        """Σ_{u<s} B_u: the log-decay from the chunk's start to sub-chunk s's start."""
        return sum(jnp.where(u < s, self.totals[u], 0.0) for u in range(self.n_sub))

    def after(self, s):
        """Σ_{u>s} B_u: from sub-chunk s's end to the chunk's end."""
        return sum(jnp.where(u > s, self.totals[u], 0.0) for u in range(self.n_sub))

    def all(self):
        return sum(self.totals)

    def from_start(self, width_columns=None):
        """G_i for every row of the chunk, [C, Dg] (or the gate columns `width_columns`)."""
        columns = slice(None) if width_columns is None else width_columns
        b = self.b_ref[:, columns].astype(F32)
        r = rows(self.n_sub * SUB)
        offset = jnp.zeros(b.shape, F32)
        for u in range(self.n_sub - 1):
            total = self.b_ref[pl.ds(u * SUB + SUB - 1, 1), columns].astype(F32)
            offset = offset + jnp.where(r >= (u + 1) * SUB, total, 0.0)
        return b + offset


# ------------------------------------------------------------------------------ scores


def diagonal_scores(q, k, b, k_ref, b_ref, start, with_kk: bool):
    """The diagonal 16 × 16 block of A^{qk} (without the scale; j ≤ i) and of A^{kk} (j < i) of the
    sub-chunk at row `start` of the refs: q, k [16, Dk] and b [16, Dg] (None: no gate) are its rows;
    column j's key and gate are read from the refs. Decays e^{b_i − b_j} ≤ 1 on the rows that use them."""
    r, c = rows(SUB), cols(SUB)

    def column(j, carry):
        a_qk, a_kk = carry
        key = k_ref[pl.ds(start + j, 1), :].astype(F32)                      # [1, Dk]
        if b is not None:
            key = key * jnp.exp(jnp.minimum(b - b_ref[pl.ds(start + j, 1), :].astype(F32), 0.0))
        a_qk = jnp.where((c == j) & (r >= j), jnp.sum(q * key, axis=1, keepdims=True), a_qk)
        if with_kk:
            a_kk = jnp.where((c == j) & (r > j), jnp.sum(k * key, axis=1, keepdims=True), a_kk)
        return a_qk, a_kk

    zeros = jnp.zeros((SUB, SUB), F32)
    return lax.fori_loop(0, SUB, column, (zeros, zeros))


def _scores_kernel(*refs, delta: bool, gated: bool, n_sub: int, scale: float, dtype):
    it = iter(refs)
    q_ref, k_ref = next(it), next(it)                     # q: the sub-chunk's rows; k: the whole chunk
    b_ref = next(it) if gated else None                   # the whole chunk
    a_ref, qg_ref, kg_ref = next(it), next(it), next(it)  # the sub-chunk's rows
    gamma_ref = next(it) if gated else None
    akk_ref = next(it) if delta else None
    s = pl.program_id(2)
    start = s * SUB
    q = q_ref[...].astype(F32)
    k = k_ref[pl.ds(start, SUB), :].astype(F32)
    gates = ChunkGates(b_ref, n_sub) if gated else None
    b = b_ref[pl.ds(start, SUB), :].astype(F32) if gated else None
    if gated:
        qg_ref[...] = (scale * q * jnp.exp(b + gates.before(s))).astype(qg_ref.dtype)
        kg_ref[...] = (k * jnp.exp(gates.total(s) - b + gates.after(s))).astype(kg_ref.dtype)

        @pl.when(s == 0)
        def _():
            gamma_ref[...] = jnp.exp(gates.all()).reshape(gamma_ref.shape)
    else:
        qg_ref[...] = (scale * q).astype(qg_ref.dtype)
        kg_ref[...] = k.astype(kg_ref.dtype)

    def put(ref, t, block):
        ref[:, pl.ds(t * SUB, SUB)] = block.astype(ref.dtype)

    diag_qk, diag_kk = diagonal_scores(q, k, b, k_ref, b_ref, start, delta)
    put(a_ref, s, scale * diag_qk)
    if delta:
        put(akk_ref, s, diag_kk)
    q_in, k_in = (q * jnp.exp(b), k * jnp.exp(b)) if gated else (q, k)        # e^{b_i}: from s's start

    def left_block(step, crossed):                        # the block of sub-chunk t = s − 1 − step
        t = s - 1 - step
        key = k_ref[pl.ds(t * SUB, SUB), :].astype(F32)
        if gated:                                         # e^{B_t − b_j + Σ_{t<u<s} B_u}: j to s's start
            b_t = b_ref[pl.ds(t * SUB, SUB), :].astype(F32)
            total = gates.total(t)
            key = key * jnp.exp(total - b_t + crossed)
            crossed = crossed + total
        put(a_ref, t, scale * dot_t(q_in, key, dtype))
        if delta:
            put(akk_ref, t, dot_t(k_in, key, dtype))
        return crossed

    width = b_ref.shape[1] if gated else 1
    lax.fori_loop(0, s, left_block, jnp.zeros((1, width), F32))

    def right_block(t, carry):
        put(a_ref, t, jnp.zeros((SUB, SUB), F32))
        if delta:
            put(akk_ref, t, jnp.zeros((SUB, SUB), F32))
        return carry

    lax.fori_loop(s + 1, n_sub, right_block, 0)


# ------------------------------------------------------------------------------ solve and W, Ũ


def unit_lower_inverse(t, exact=F32):
    """Inverse of a unit lower-triangular [16, 16] block: with N = T − I strictly lower (N¹⁶ = 0),
    (I + N)⁻¹ = (I − N)(I + N²)(I + N⁴)(I + N⁸). Seven fp32 dots (`exact`: their operand_type), no
    row-by-row recursion."""
    eye = identity(SUB)
    n = t - eye
    n2 = dot(n, n, exact)
    n4 = dot(n2, n2, exact)
    n8 = dot(n4, n4, exact)
    return dot(dot(dot(eye - n, eye + n2, exact), eye + n4, exact), eye + n8, exact)


def _solve_wy_kernel(k_ref, v_ref, b_ref, beta_ref, akk_ref, w_ref, u_ref, m_ref, *, n_sub: int, dtype, exact):
    C = n_sub * SUB
    beta = [beta_ref[pl.ds(s * SUB, SUB), :].astype(F32) for s in range(n_sub)]   # [16, 1]
    inverse_rows = []                                     # M's row blocks [16, C]
    for s in range(n_sub):
        rhs = jnp.where(cols(C, SUB) == rows(SUB, C) + s * SUB, 1.0, 0.0)       # E_s
        for t in range(s):
            t_st = beta[s] * akk_ref[pl.ds(s * SUB, SUB), pl.ds(t * SUB, SUB)]
            rhs = rhs - dot(t_st, inverse_rows[t], exact)
        t_ss = identity(SUB) + beta[s] * akk_ref[pl.ds(s * SUB, SUB), pl.ds(s * SUB, SUB)]
        inverse_rows.append(dot(unit_lower_inverse(t_ss, exact), rhs, exact))
        m_ref[pl.ds(s * SUB, SUB), :] = inverse_rows[-1]
    beta_all = beta_ref[...].astype(F32)                  # [C, 1]
    gates = ChunkGates(b_ref, n_sub)
    scalar_gate = b_ref.shape[1] == 1

    def w_block(columns, carry):
        gamma = jnp.exp(gates.from_start(pl.ds(0, 1) if scalar_gate else columns))
        weighted = beta_all * k_ref[:, columns].astype(F32) * gamma
        for s in range(n_sub):
            w_ref[pl.ds(s * SUB, SUB), columns] = dot(inverse_rows[s], weighted, dtype).astype(w_ref.dtype)
        return carry

    def u_block(columns, carry):
        weighted = beta_all * v_ref[:, columns].astype(F32)
        for s in range(n_sub):
            u_ref[pl.ds(s * SUB, SUB), columns] = dot(inverse_rows[s], weighted, dtype).astype(u_ref.dtype)
        return carry

    column_loop(k_ref.shape[1], w_block, 0, dtype)
    column_loop(v_ref.shape[1], u_block, 0, dtype)


# ------------------------------------------------------------------------------ both


def intra_chunk(q, k, v, b, beta, *, chunk: int, scale: float, dtype, interpret: bool) -> IntraChunk:
    """K1 for all chunks. q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv] (None: no delta rule), b [B,T,H,Dg]
    sub-chunk cumulative gates (None: no decay; the delta rule needs one), beta [B,T,H,1] (with v)."""
    B, T, H, Dk = q.shape
    Hkv = k.shape[2]
    C, N, n_sub = chunk, T // chunk, chunk // SUB
    delta, gated = beta is not None, b is not None
    layout = Layout(H, Hkv, C)
    dtype = jnp.dtype(dtype)
    a_dtype = F32 if dtype == F32 else dtype
    ops = operand_type(dtype, interpret)
    rows_of = functools.partial(layout.sub_chunk, axes="nbs")
    chunk_of = functools.partial(layout.tokens, axes="nbs")
    inputs, in_specs = [q, k], [rows_of(Dk), chunk_of(Dk, kv=True)]
    if gated:
        inputs.append(b)
        in_specs.append(chunk_of(b.shape[-1]))
    shapes = [((B, T, H, C), a_dtype, rows_of(C)), ((B, T, H, Dk), dtype, rows_of(Dk)),
              ((B, T, H, Dk), dtype, rows_of(Dk))]
    if gated:
        shapes.append(((B, N, H, b.shape[-1]), F32, layout.per_chunk(b.shape[-1], axes="nbs")))
    if delta:
        shapes.append(((B, T, H, C), F32, rows_of(C)))
    out = pl.pallas_call(
        functools.partial(_scores_kernel, delta=delta, gated=gated, n_sub=n_sub, scale=scale, dtype=ops),
        out_shape=[jax.ShapeDtypeStruct(shape, dt) for shape, dt, _ in shapes], grid=(N, B * H, n_sub),
        in_specs=in_specs, out_specs=[spec for _, _, spec in shapes], compiler_params=triton_params(),
        interpret=interpret, name="linjax_chunk_scores",
    )(*inputs)
    a_qk, q_gated, k_gated = out[:3]
    gamma = out[3] if gated else None
    if not delta:
        return IntraChunk(a_qk, q_gated, k_gated, gamma, None, None, None, None)
    a_kk = out[-1]
    Dv = v.shape[-1]
    on = functools.partial(layout.tokens, axes="nb")
    w, u_tilde, inverse = pl.pallas_call(
        functools.partial(_solve_wy_kernel, n_sub=n_sub, dtype=ops, exact=operand_type(F32, interpret)),
        out_shape=[jax.ShapeDtypeStruct((B, T, H, Dk), dtype), jax.ShapeDtypeStruct((B, T, H, Dv), dtype),
                   jax.ShapeDtypeStruct((B, T, H, C), F32)], grid=(N, B * H),
        in_specs=[on(Dk, kv=True), on(Dv, kv=True), on(b.shape[-1]), on(1), on(C)],
        out_specs=[on(Dk), on(Dv), on(C)], compiler_params=triton_params(), interpret=interpret,
        name="linjax_chunk_solve_wy",
    )(k, v, b, beta, a_kk)
    return IntraChunk(a_qk, q_gated, k_gated, gamma, w, u_tilde, inverse, a_kk)
