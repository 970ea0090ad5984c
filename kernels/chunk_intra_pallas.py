"""The delta rule's in-chunk work (K1 of gdn.py's `_chunks_then_states`) as one Pallas (Triton)
kernel, every chunk in parallel, with its gradient from the batched XLA form behind a
`jax.custom_vjp`.

For one chunk of C tokens (gdn.py has the equations), with G_i = Σ_{t≤i} log α_t per channel:

    A^{qk}_ij = Σ_d q_id k_jd e^{G_id − G_jd}  (j ≤ i, 0 above the diagonal)
    T = I + Diag(β) tril₋₁(A^{kk}),  W = T⁻¹Diag(β)(K⊙Γ),  Ũ = T⁻¹Diag(β)V,  Γ_i = e^{G_i}
    Q⊙Γ,  K⊙e^{G_C − G},  and the chunk's decay Γ_C

Grid (chunk, batch × head): one program per chunk, all independent. Inside, the chunk is split
into sub-chunks of 16 rows (Triton's smallest dot), each loaded from the refs as its own value
(Triton cannot slice values held in registers) and results stored block by block:

- Decays are products of the per-token factors a_t = e^{log α_t} ≤ 1, never e^{G_i − G_j} from a
  difference of cumulative sums (which loses the small exponents next to a −1000 reset), as in
  decay.py. Per sub-chunk one loop over its 16 columns j, last to first, carries the decay
  e^{G_i − G_j} of every row i ≥ j (multiply by a_{j+1}, reset row j to 1): it gives the diagonal
  16 × 16 blocks of A^{qk} and A^{kk} column by column, the suffix products Π_{t∈(j,end]} a_t and,
  at the end, the prefix products Π_{t≤i} a_t.
- Off-diagonal blocks (row sub-chunk I > column sub-chunk J) are dots through the boundary m at the
  end of J: e^{G_i − G_j} = e^{G_i − G_m} · e^{G_m − G_j}, both factors products ≤ 1.
- T⁻¹ by forward substitution in blocks, [[P, 0], [X, Q]]⁻¹ = [[P⁻¹, 0], [−Q⁻¹XP⁻¹, Q⁻¹]], with each
  16 × 16 diagonal inverse by a 16-step row recursion, all in fp32 at full precision.
- The dots of A's off-diagonal blocks, W and Ũ take operands in `dtype` (bf16 on tensor cores)
  with fp32 accumulation; fp32 operands run at Precision.HIGHEST (IEEE, not TF32).
- W, Ũ and K⊙e^{G_C − G}, which only the state pass reads (it takes its operands in `dtype`), are
  written in `dtype`; A^{qk}, Q⊙Γ and the chunk decay, read by the XLA outputs, in fp32.

Backward: `jax.vjp` of the XLA function passed as `recompute` (gdn.in_chunk_xla), which computes the
same outputs: exact gradients of the same function.

Tested (tests/kernels/test_chunk_intra_pallas.py, interpreted on a CPU): each output against
gdn.in_chunk_xla at fp32 tolerances for per-channel and scalar gates, hard resets, chunks of 16,
32 and 64, Dk not a power of two; gdn.pallas with it against gdn.reference (outputs and gradients,
T not a multiple of 64, GQA); its CUDA lowering as a Triton call, and its dots' precisions.

    in_chunk(q, k, v, log_gate, beta, *, dtype, interpret, recompute)
        -> (a_qk, w, u_tilde, q_gated, k_out, chunk_decay)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.pallas_common import pad_axis, tile_size, triton_params

__all__ = ["in_chunk", "SUB"]

_F32 = jnp.float32
SUB = 16  # rows of a sub-chunk: Triton's smallest dot side


def _precision(dtype):
    """fp32 operands at full precision: Triton would run them as TF32 otherwise."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == _F32 else None


def _dot(a, b, dtype):
    """a @ b with operands in `dtype`, accumulated in fp32."""
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())),
                           precision=_precision(dtype), preferred_element_type=_F32)


def _dot_t(a, b, dtype):
    """a @ bᵀ."""
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                           precision=_precision(dtype), preferred_element_type=_F32)


def _rows():
    return lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)


def _cols():
    return lax.broadcasted_iota(jnp.int32, (1, SUB), 1)


def _row(x, i):
    """Row i of a [SUB, D] value as [1, D], by a masked sum (values in registers cannot be sliced)."""
    return jnp.sum(jnp.where(_rows() == i, x, 0.0), axis=0, keepdims=True)


def _diagonal_block(q, k, a):
    """One sub-chunk: (A^{qk}, strictly-lower A^{kk}) [SUB, SUB], prefix products Π_{t≤i} a_t,
    suffix products Π_{t∈(i,end]} a_t [SUB, D], and the sub-chunk's total product [1, D]."""
    rows, cols = _rows(), _cols()

    def column(step, carry):
        j = SUB - 1 - step
        decay, suffix, running, a_qk, a_kk = carry
        # decay held e^{G_i − G_{j+1}} on rows i > j; now e^{G_i − G_j} on rows i ≥ j, 0 above.
        decay = jnp.where(rows > j, decay * _row(a, j + 1), jnp.where(rows == j, 1.0, 0.0))
        suffix = jnp.where(rows == j, running, suffix)
        running = running * _row(a, j)
        weighted_key = _row(k, j) * decay
        a_qk = jnp.where(cols == j, jnp.sum(q * weighted_key, axis=1, keepdims=True), a_qk)
        a_kk = jnp.where((cols == j) & (rows > j), jnp.sum(k * weighted_key, axis=1, keepdims=True), a_kk)
        return decay, suffix, running, a_qk, a_kk

    zeros = jnp.zeros(q.shape, _F32)
    square = jnp.zeros((SUB, SUB), _F32)
    decay, suffix, total, a_qk, a_kk = lax.fori_loop(
        0, SUB, column, (zeros, zeros, jnp.ones((1, q.shape[1]), _F32), square, square))
    return a_qk, a_kk, decay * _row(a, 0), suffix, total


def _unit_lower_inverse(t):
    """Inverse of a unit lower-triangular [SUB, SUB] block, row by row: M_i = e_i − Σ_{j<i} T_ij M_j."""
    rows, cols = _rows(), _cols()
    strict_t = jnp.where(rows > cols, t, 0.0).T                      # column i holds row i of T

    def row(i, m):
        t_row = jnp.sum(jnp.where(cols == i, strict_t, 0.0), axis=1, keepdims=True)   # [SUB, 1]: T_ij
        new = jnp.where(cols == i, 1.0, 0.0) - jnp.sum(t_row * m, axis=0, keepdims=True)
        return jnp.where(rows == i, new, m)

    return lax.fori_loop(0, SUB, row, jnp.zeros((SUB, SUB), _F32))


def _product(factors):
    out = factors[0]
    for f in factors[1:]:
        out = out * f
    return out


def _kernel(q_ref, k_ref, v_ref, g_ref, beta_ref,
            a_ref, w_ref, u_ref, qg_ref, kd_ref, decay_ref, *, n_sub, dtype):
    part = lambda ref, s: ref[pl.ds(s * SUB, SUB), :].astype(_F32)
    q = [part(q_ref, s) for s in range(n_sub)]
    k = [part(k_ref, s) for s in range(n_sub)]
    beta = [beta_ref[pl.ds(s * SUB, SUB)].astype(_F32)[:, None] for s in range(n_sub)]
    diagonal = [_diagonal_block(q[s], k[s], jnp.exp(part(g_ref, s))) for s in range(n_sub)]
    a_qk_diag, a_kk_diag, prefix, suffix, total = map(list, zip(*diagonal))
    ones = jnp.ones_like(total[0])
    between = lambda lo, hi: _product([ones] + total[lo:hi])           # Π over sub-chunks lo..hi−1

    # Chunk-level decays: Γ from the chunk start, e^{G_C − G} to its end.
    gamma = [prefix[s] * between(0, s) for s in range(n_sub)]
    to_end = [suffix[s] * between(s + 1, n_sub) for s in range(n_sub)]
    decay_ref[...] = between(0, n_sub)

    # A^{qk} and T block by block; off-diagonal blocks through the end of the column sub-chunk.
    t_blocks = {}
    for i in range(n_sub):
        for j in range(n_sub):
            if j > i:
                block = jnp.zeros((SUB, SUB), _F32)
            elif j == i:
                block = a_qk_diag[i]
                rows_id = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0) == lax.broadcasted_iota(
                    jnp.int32, (SUB, SUB), 1)
                t_blocks[i, i] = jnp.where(rows_id, 1.0, 0.0) + beta[i] * a_kk_diag[i]
            else:
                into_row = prefix[i] * between(j + 1, i)                   # e^{G_i − G_m}, m = end of j
                column_keys = k[j] * suffix[j]                           # e^{G_m − G_c} k_c
                block = _dot_t(q[i] * into_row, column_keys, dtype)
                t_blocks[i, j] = beta[i] * _dot_t(k[i] * into_row, column_keys, dtype)
            a_ref[pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = block

    # T⁻¹ by block forward substitution: M_ii = T_ii⁻¹, M_ij = −M_ii Σ_{j≤l<i} T_il M_lj.
    inverse = {}
    for i in range(n_sub):
        inverse[i, i] = _unit_lower_inverse(t_blocks[i, i])
        for j in range(i - 1, -1, -1):
            acc = _dot(t_blocks[i, j], inverse[j, j], _F32)
            for l in range(j + 1, i):
                acc = acc + _dot(t_blocks[i, l], inverse[l, j], _F32)
            inverse[i, j] = -_dot(inverse[i, i], acc, _F32)

    v = [part(v_ref, s) for s in range(n_sub)]
    weighted_keys = [beta[s] * k[s] * gamma[s] for s in range(n_sub)]
    weighted_values = [beta[s] * v[s] for s in range(n_sub)]
    for i in range(n_sub):
        w = _dot(inverse[i, 0], weighted_keys[0], dtype)
        u = _dot(inverse[i, 0], weighted_values[0], dtype)
        for j in range(1, i + 1):
            w = w + _dot(inverse[i, j], weighted_keys[j], dtype)
            u = u + _dot(inverse[i, j], weighted_values[j], dtype)
        rows = pl.ds(i * SUB, SUB)
        w_ref[rows, :] = w.astype(w_ref.dtype)
        u_ref[rows, :] = u.astype(u_ref.dtype)
        qg_ref[rows, :] = q[i] * gamma[i]
        kd_ref[rows, :] = (k[i] * to_end[i]).astype(kd_ref.dtype)


def _forward(q, k, v, log_gate, beta, dtype, interpret):
    """[N, BH, C, D] inputs (D padded to tiles, the gate per channel) -> the six outputs."""
    N, BH, C, Dk = q.shape
    Dv = v.shape[-1]
    sq = pl.squeezed
    spec = lambda *tail: pl.BlockSpec((sq, sq, *tail), lambda n, bh: (n, bh) + (0,) * len(tail))
    out_shape = [jax.ShapeDtypeStruct((N, BH, C, C), _F32), jax.ShapeDtypeStruct((N, BH, C, Dk), dtype),
                 jax.ShapeDtypeStruct((N, BH, C, Dv), dtype), jax.ShapeDtypeStruct((N, BH, C, Dk), _F32),
                 jax.ShapeDtypeStruct((N, BH, C, Dk), dtype), jax.ShapeDtypeStruct((N, BH, 1, Dk), _F32)]
    return pl.pallas_call(
        functools.partial(_kernel, n_sub=C // SUB, dtype=dtype),
        out_shape=out_shape, grid=(N, BH),
        in_specs=[spec(C, Dk), spec(C, Dk), spec(C, Dv), spec(C, Dk), spec(C)],
        out_specs=[spec(C, C), spec(C, Dk), spec(C, Dv), spec(C, Dk), spec(C, Dk), spec(1, Dk)],
        compiler_params=triton_params(), interpret=interpret, name="linjax_gdn_in_chunk_fwd",
    )(q, k, v, log_gate, beta)


def _run(q, k, v, log_gate, beta, dtype, interpret):
    """Pads, flattens batch × head, runs the kernel and restores [N, B, H, C, ...] shapes."""
    N, B, H, C, Dk = q.shape
    Dv = v.shape[-1]
    Dkp, Dvp = tile_size(Dk), tile_size(Dv)
    flat = lambda x, width: pad_axis(x, x.ndim - 1, width).reshape(N, B * H, C, width)
    a_qk, w, u, qg, kd, chunk_decay = _forward(
        flat(q, Dkp), flat(k, Dkp), flat(v, Dvp), flat(log_gate, Dkp), beta.reshape(N, B * H, C),
        dtype, interpret)
    back = lambda x, width: x.reshape(N, B, H, x.shape[-2], x.shape[-1])[..., :width]
    return (back(a_qk, C), back(w, Dk), back(u, Dv), back(qg, Dk), back(kd, Dk),
            back(chunk_decay, Dk)[..., 0, :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _in_chunk(q, k, v, log_gate, beta, dtype, interpret, recompute):
    return _run(q, k, v, log_gate, beta, dtype, interpret)


def _in_chunk_forward(q, k, v, log_gate, beta, dtype, interpret, recompute):
    return _run(q, k, v, log_gate, beta, dtype, interpret), (q, k, v, log_gate, beta)


def _in_chunk_backward(dtype, interpret, recompute, inputs, cotangents):
    return jax.vjp(recompute, *inputs)[1](tuple(c.astype(_F32) for c in cotangents))


_in_chunk.defvjp(_in_chunk_forward, _in_chunk_backward)


def in_chunk(q, k, v, log_gate, beta, *, dtype, interpret, recompute):
    """q, k [N, B, H, C, Dk], v [N, B, H, C, Dv], log_gate [N, B, H, C, Dk or 1], beta [N, B, H, C],
    all fp32; C a multiple of 16. Returns `recompute`'s results (A^{qk} [.., C, C], W, Ũ, Q⊙Γ,
    K⊙e^{G_C − G} [.., C, D], Γ_C [N, B, H, Dk]) computed by the kernel with dot operands in `dtype`,
    W, Ũ and K⊙e^{G_C − G} in `dtype` (what the state pass takes), the others fp32; gradients are
    `recompute`'s."""
    C = q.shape[-2]
    if C % SUB:
        raise ValueError(f"the in-chunk kernel needs a chunk that is a multiple of {SUB}; got {C}")
    log_gate = jnp.broadcast_to(log_gate, q.shape)
    return _in_chunk(q, k, v, log_gate, beta, jnp.dtype(dtype), interpret, recompute)
