"""Gated delta rule (the paper's "GDN", Kimi Delta Attention form), pure JAX.

Per query head, with keys/values repeated to the query heads (HF `repeat_kv`):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ        S ∈ R^{Dk×Dv}
    o_t = scale · S_tᵀ q_t                                          (S_t includes token t)

`log_alpha` is log α_t, either per channel [B,T,H,Dk] (Kimi / the paper's GDN) or one
scalar per head [B,T,H] (the original GDN); the rank tells which. Gates are expected to
be ≤ 0 (e.g. LogSigmoid); −inf-like values such as −1000 are a hard reset. q and k are
used as given: the caller L2-normalises them.

Functions (ARCHITECTURE.md, "Kernel contract"):
    reference  fp32 `lax.scan` over tokens: the spec.
    chunked    chunk-parallel WY/UT form, what training uses; differentiable by autodiff.
    step       one decode token.
    pallas     the same as `chunked` as one Pallas (GPU) kernel, gdn_pallas.py.
All return (o [B,T,H,Dv] in v's dtype, final_state [B,H,Dk,Dv] fp32).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from linjax.kernels import gdn_pallas
from linjax.kernels.contract import (as_token_batch, check_qkv, check_shape, default_scale, expand_kv_heads,
                                     initial_state_or_zeros)
from linjax.kernels.pallas_common import default_interpret, with_chunked_backward

__all__ = ["reference", "chunked", "step", "pallas", "CHUNK", "PALLAS_CHUNK"]

# Default chunk of `chunked`: on a 2-core CPU (B=1, H=8, D=128, T=4096) forward+backward took 0.66 s
# with 32, 0.72 s with 64 and 0.69 s with 16 (forward 0.21, 0.25, 0.19 s): the 64-wide block inverse
# and decay tree cost more than the shorter scan over chunks saves.
CHUNK = 32
# Default chunk of `pallas`: that measurement does not carry over, since the kernel solves each chunk
# in 16-token sub-chunks with the state held in registers, and a longer chunk means fewer serial
# steps of its loop. 64 is the block FLA's delta-rule kernels use; untuned (no GPU was at hand).
PALLAS_CHUNK = 64


# ----------------------------------------------------------------------------- inputs


def _prepare(q, k, v, log_alpha, beta, state, scale, *, per_token=False):
    """Checked fp32 inputs with k, v repeated to the query heads and a trailing gate axis
    (Dk, or 1 for a scalar gate, which then broadcasts over Dk everywhere). `per_token`:
    one decode token, shapes without the T axis."""
    B, _, H, _, Dk, Dv = (as_token_batch if per_token else check_qkv)(q, k, v)
    heads = q.shape[:-1]
    if log_alpha.shape == q.shape:
        per_channel = True
    elif log_alpha.shape == heads:
        per_channel = False
    else:
        raise ValueError(f"log_alpha must be {q.shape} (per channel) or {heads} (scalar per "
                         f"head); got {log_alpha.shape}")
    check_shape(beta, heads, "beta")
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    la = f32(log_alpha) if per_channel else f32(log_alpha)[..., None]
    state = initial_state_or_zeros(state, (B, H, Dk, Dv), "state" if per_token else "initial_state")
    return (f32(q), f32(expand_kv_heads(k, H)), f32(expand_kv_heads(v, H)), la, f32(beta), state,
            default_scale(scale, Dk))


# ---------------------------------------------------------------------- recurrent form


def _update(S, q, k, v, la, beta, scale):
    """One token of the recurrence, all [B,H,...] fp32. Written as
    S' = Diag(α)S + β k (v − kᵀ Diag(α)S)ᵀ, which equals (I − βkkᵀ)Diag(α)S + βkvᵀ."""
    S = S * jnp.exp(la)[..., None]                                   # Diag(α_t) S_{t-1}
    err = v - jnp.einsum("bhk,bhkv->bhv", k, S)                      # v_t − kᵀ Diag(α) S
    S = S + jnp.einsum("bhk,bhv->bhkv", k, beta[..., None] * err)
    return S, scale * jnp.einsum("bhk,bhkv->bhv", q, S)


def step(q, k, v, log_alpha, beta, *, state, scale=None):
    """One decode token. q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv], log_alpha [B,H,Dk] or
    [B,H], beta [B,H], state [B,H,Dk,Dv] fp32 (or None for zeros).
    Returns (o [B,H,Dv] in v's dtype, new_state [B,H,Dk,Dv] fp32)."""
    q32, k32, v32, la, b, S, scale = _prepare(q, k, v, log_alpha, beta, state, scale,
                                              per_token=True)
    S, o = _update(S, q32, k32, v32, la, b, scale)
    return o.astype(v.dtype), S


def reference(q, k, v, log_alpha, beta, *, scale=None, initial_state=None):
    """The spec: the recurrence token by token in fp32 with `lax.scan`.
    q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], log_alpha [B,T,H,Dk] or [B,T,H],
    beta [B,T,H], initial_state [B,H,Dk,Dv] or None.
    Returns (o [B,T,H,Dv] in v's dtype, final_state [B,H,Dk,Dv] fp32)."""
    q32, k32, v32, la, b, S, scale = _prepare(q, k, v, log_alpha, beta, initial_state, scale)
    time_first = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_first, (q32, k32, v32, la, b)))
    S, o = jax.lax.scan(lambda S, x: _update(S, *x, scale), S, xs)
    return time_first(o).astype(v.dtype), S


# -------------------------------------------------------------------- chunk-parallel form
#
# Inside a chunk of C tokens with state S_0 on entry, write Γ_i = exp(G_i), G_i = Σ_{t≤i} log α_t
# (per channel) and S_i = Diag(α_i) S_{i-1} + k_i u_iᵀ with the "new value"
# u_i = β_i (v_i − k_iᵀ Diag(α_i) S_{i-1}). Unrolling S_{i-1} gives, for all i at once,
#
#     u_i + β_i Σ_{j<i} A_ij u_j = β_i (v_i − (k_i ⊙ Γ_i)ᵀ S_0),   A_ij = Σ_d k_id k_jd e^{G_id − G_jd}
#
# a unit lower-triangular system (I + Diag(β) tril₋₁(A)) U = Diag(β)(V − (K⊙Γ) S_0). Its solution
# is U = Ũ − W S_0 with Ũ = T⁻¹Diag(β)V and W = T⁻¹Diag(β)(K⊙Γ) (the WY / UT transform), which
# need no state and are computed for every chunk in parallel. The scan over chunks is then
#     U = Ũ − W S_0,   S_C = Diag(Γ_C) S_0 + (K ⊙ e^{G_C − G})ᵀ U,
# and outputs are o = scale·[(Q⊙Γ) S_0 + tril(A^{qk}) U], A^{qk}_ij = Σ_d q_id k_jd e^{G_id − G_jd}.
#
# Decays are never formed as e^{−G}: every exponent is a segment sum Σ_{t∈(a,b]} log α_t ≤ 0,
# computed directly by a 0/1 matrix product (not as a difference of two cumulative sums, which
# loses the small exponents next to a −1000 reset). The [C,C,Dk] decay of A is never built either:
# A's lower triangle is split recursively into halves, and the off-diagonal block of each pair of
# halves factors exactly through the boundary m between them,
#     e^{G_i − G_j} = e^{G_i − G_m} · e^{G_m − G_j},   i > m ≥ j,   both factors ≤ 1,
# so each of the log2(C) levels costs one exp per element of q/k plus small matmuls.


def _segment_matrices(C: int) -> np.ndarray:
    """0/1 matrices M [L+2, C, C] such that (M[l] @ log α)[p] is the exponent at position p:
    for the tree levels (half size h = 1, 2, ..., C/2) the sum between p and its block's
    boundary m, then Σ_{t≤p} (decay from the chunk start) and Σ_{t>p} (decay to the chunk end)."""
    levels = []
    p = np.arange(C)
    t = np.arange(C)
    h = 1
    while h < C:
        m = (p // (2 * h)) * 2 * h + h - 1                      # last position of the lower half
        upper = (p % (2 * h)) >= h
        into = upper[:, None] & (t > m[:, None]) & (t <= p[:, None])      # Σ_{t∈(m,p]}
        out_of = ~upper[:, None] & (t > p[:, None]) & (t <= m[:, None])   # Σ_{t∈(p,m]}
        levels.append(into | out_of)
        h *= 2
    levels.append(t[None, :] <= p[:, None])
    levels.append(t[None, :] > p[:, None])
    return np.stack(levels).astype(np.float32)


def _merge(prev, cross):
    """Blocks [..., 2n, h, h] (diagonal) and [..., n, h, h] (lower-left) -> [..., n, 2h, 2h]."""
    n, h = cross.shape[-3], cross.shape[-1]
    prev = prev.reshape(*prev.shape[:-3], n, 2, h, h)
    zero = jnp.zeros_like(cross)
    top = jnp.concatenate([prev[..., 0, :, :], zero], axis=-1)
    bottom = jnp.concatenate([cross, prev[..., 1, :, :]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def _intra_chunk(q, k, beta, factors):
    """A^{qk} = tril(Q Kᵀ ⊙ decay) and T⁻¹ = (I + Diag(β) tril₋₁(K Kᵀ ⊙ decay))⁻¹, [..., C, C],
    from the level factors, a list of L arrays [..., C, Dg] = exp(segment sums): the recursive
    halving above.

    T⁻¹ is built in the same pass by 2×2 block inversion of a unit lower-triangular matrix,
        [[P, 0], [X, R]]⁻¹ = [[P⁻¹, 0], [−R⁻¹ X P⁻¹, R⁻¹]],
    merging the inverses of the two halves with the cross block X of the same level. That is
    forward substitution in blocks, as exact, using matrix products only: no LAPACK call, whose
    XLA:CPU kernel can deadlock the worker pool it shares with other ops (issue 15)."""
    a_qk = jnp.sum(q * k, axis=-1)[..., None, None]          # [..., C, 1, 1]: decay 1 on the diagonal
    t_inv = jnp.ones_like(a_qk)                               # 1 × 1 blocks of a unit diagonal
    C = q.shape[-2]
    for level, f in enumerate(factors):
        h = 2 ** level
        split = lambda x: x.reshape(*x.shape[:-2], C // (2 * h), 2, h, x.shape[-1])
        qf, kf = split(q * f), split(k * f)
        lower = kf[..., 0, :, :]                               # e^{G_m − G_j} k_j
        a_qk = _merge(a_qk, jnp.einsum("...nid,...njd->...nij", qf[..., 1, :, :], lower))
        cross = split(beta[..., None])[..., 1, :, :] * jnp.einsum("...nid,...njd->...nij",
                                                                  kf[..., 1, :, :], lower)
        halves = t_inv.reshape(*t_inv.shape[:-3], C // (2 * h), 2, h, h)
        first, second = halves[..., 0, :, :], halves[..., 1, :, :]
        t_inv = _merge(t_inv, -(second @ cross @ first))
    return a_qk[..., 0, :, :], t_inv[..., 0, :, :]


def _chunk_size(chunk: int, T: int) -> int:
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two; got {chunk}")
    return min(chunk, 1 << max(T - 1, 0).bit_length())      # short inputs: smallest fitting chunk


def chunked(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=CHUNK):
    """Chunk-parallel gated delta rule; same arguments and results as `reference`.
    `chunk` (a power of two) is the block length; any T works (padded inside with β = 0,
    log α = 0, which leaves the state unchanged). Memory is linear in T."""
    q32, k32, v32, la, beta32, S0, scale = _prepare(q, k, v, log_alpha, beta, initial_state, scale)
    B, T, H, Dk = q.shape
    C = _chunk_size(chunk, T)
    N = -(-T // C)

    def blocks(x):  # [B,T,H,...] -> [B,H,N,C,...], zero-padded in time
        x = jnp.pad(x, [(0, 0), (0, N * C - T)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, N, C, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q32, k32, v32, la, beta32 = map(blocks, (q32, k32, v32, la, beta32))
    # One [C, C] 0/1 matrix per segment-sum level, applied as a product batched over (B, H, N): the
    # result keeps Dg minor, the layout every consumer reads. (One einsum over all levels at once puts
    # the level and position axes minor, and XLA:CPU then re-transposes it inside each consumer.)
    M = jnp.asarray(_segment_matrices(C))
    factors = [jnp.exp(jnp.broadcast_to(m, (*la.shape[:-2], C, C)) @ la) for m in M]  # [B,H,N,C,Dg], ≤ 1
    tree, from_start, to_end = factors[:-2], factors[-2], factors[-1]

    a_qk, t_inv = _intra_chunk(q32, k32, beta32, tree)    # T = I + Diag(β) tril₋₁(A), [B,H,N,C,C]
    t_inv = t_inv * beta32[..., None, :]                   # T⁻¹Diag(β): then W and Ũ are two matmuls
    w = t_inv @ (k32 * from_start)                         # W [B,H,N,C,Dk]
    u_tilde = t_inv @ v32                                  # Ũ [B,H,N,C,Dv]
    k_out_t = jnp.swapaxes(k32 * to_end, -1, -2)           # (k_j ⊙ e^{G_C − G_j})ᵀ [B,H,N,Dk,C]
    decay = from_start[..., -1, :]                         # Γ_C [B,H,N,Dg]
    q_in = q32 * from_start                                # q_i ⊙ Γ_i

    # The outputs are formed inside the scan, so it hands back o [C, Dv] per chunk rather than
    # the [Dk, Dv] state each chunk starts from (stacking those states cost as much as the scan).
    def chunk_step(S, x):
        w, u_tilde, k_out_t, decay, q_in, a_qk = x
        u = u_tilde - w @ S
        o = q_in @ S + a_qk @ u
        return decay[..., None] * S + k_out_t @ u, o

    along_n = lambda x: jnp.moveaxis(x, 2, 0)
    S_final, o = jax.lax.scan(chunk_step, S0, tuple(map(along_n, (w, u_tilde, k_out_t, decay, q_in, a_qk))))
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, N * C, H, -1)[:, :T] * scale   # [N,B,H,C,Dv] -> [B,T,H,Dv]
    return o.astype(v.dtype), S_final


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, log_alpha, beta, *, scale=None, initial_state=None, chunk=PALLAS_CHUNK, interpret=None):
    """`chunked` as one Pallas (Triton) kernel, see gdn_pallas.py; same arguments and results
    (per-channel or scalar gate).

    Differentiable through a `jax.custom_vjp` whose backward recomputes through `chunked`
    (exact, not a fused backward kernel). interpret=None runs the Pallas interpreter when
    the default backend is CPU."""
    interpret = default_interpret(interpret)
    kernel = lambda *a: gdn_pallas.forward(*a[:-1], initial_state=a[-1], scale=scale, chunk=chunk,
                                          interpret=interpret)
    spec = lambda *a: chunked(*a[:-1], initial_state=a[-1], scale=scale, chunk=chunk)
    o, state = with_chunked_backward(kernel, spec, q, k, v, log_alpha, beta, initial_state)
    return o.astype(v.dtype), state
