"""Pallas (Triton backend) forward kernel for sliding-window attention with
attention sinks: exact softmax where query t attends key j iff

    j ≤ t  and  (j < sinks  or  t − j < window).

One program per (batch, query head, block of 64 queries), flash-attention
style: an online softmax (running max m, normaliser l, accumulator) over
first the sink key blocks (keys j < sinks) and then the key blocks that
overlap the window (keys j ≥ sinks), so every key is counted once. The
window loop runs over at most ceil((64 + window − 1) / 64) + 1 key blocks
whatever T is, which is what makes the cost linear in T. Masks are applied
to the scores before the exp, with a finite "minus infinity" so a fully
masked block never makes inf − inf.

The wrapper pads T to a multiple of the block (padded queries are dropped;
padded keys lie after every real query, so the causal mask hides them) and
Dk, Dv to powers of two ≥ 16 with zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linjax.kernels.contract import check_qkv
from linjax.kernels.pallas_common import (
    load_rows, matmul, matmul_t, pad_axis, tile_size, triton_params)

_MASKED = -1e30  # finite stand-in for −inf in masked scores


def _swa_kernel(q_ref, k_ref, v_ref, num_ref, max_ref, sum_ref, *, block: int,
                window: int, sinks: int, scale: float):
    q_start = pl.program_id(2) * block
    q = q_ref[...].astype(jnp.float32) * scale                     # [BQ, Dk]
    t = q_start + lax.broadcasted_iota(jnp.int32, (block, block), 0)
    j_in_block = lax.broadcasted_iota(jnp.int32, (block, block), 1)

    def attend(kb, carry, keep_of):
        m, l, acc = carry
        k_start = kb * block
        s = matmul_t(q, load_rows(k_ref, k_start, block))          # [BQ, BK]
        keep = keep_of(k_start + j_in_block)
        s = jnp.where(keep, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
        rescale = jnp.exp(m - m_new)
        l = rescale * l + jnp.sum(p, axis=1)
        acc = rescale[:, None] * acc + matmul(p, load_rows(v_ref, k_start, block))
        return m_new, l, acc

    def sink_keys(j):
        return (j < sinks) & (j <= t)

    def window_keys(j):
        return (j >= sinks) & (j <= t) & (t - j < window)

    carry = (jnp.full((block,), _MASKED, jnp.float32),
             jnp.zeros((block,), jnp.float32),
             jnp.zeros((block, num_ref.shape[-1]), jnp.float32))
    n_sink_blocks = min(-(-sinks // block), k_ref.shape[0] // block)
    for kb in range(n_sink_blocks):
        carry = attend(kb, carry, sink_keys)
    # Key blocks from the oldest key any query of this block still sees in
    # its window (and not below the sinks) up to the block's own diagonal.
    first = jnp.maximum(jnp.maximum(q_start - window + 1, sinks), 0) // block
    last = pl.program_id(2)
    carry = lax.fori_loop(first, last + 1,
                          lambda kb, c: attend(kb, c, window_keys), carry)
    # Unnormalised, as swa.SoftmaxParts: the mixer adds the linear term.
    num_ref[...], max_ref[...], sum_ref[...] = carry[2], carry[0], carry[1]


def forward(q, k, v, *, sinks: int, window: int, scale=None, block: int,
            interpret=False):
    """Sliding-window + sink softmax attention as one Pallas call.

    q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv] (H a multiple of Hkv; query
    head h reads kv head h // (H // Hkv)); `window` ≥ 1 recent tokens
    (including the current one) plus the first `sinks` positions. Returns
    (numerator [B,T,H,Dv], row_max [B,T,H], row_sum [B,T,H]), all fp32 and
    unnormalised as in `swa.SoftmaxParts` (o = numerator / row_sum). Forward
    only.
    """
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    if window < 1 or sinks < 0:
        raise ValueError(f"need window ≥ 1 and sinks ≥ 0; got window={window}, sinks={sinks}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two ≥ 16; got {block}")
    Tp = -(-T // block) * block
    Dkp, Dvp = tile_size(Dk), tile_size(Dv)

    def prep(x, d):
        return pad_axis(pad_axis(x, 1, Tp), 3, d)

    num, row_max, row_sum = _swa_call(prep(q, Dkp), prep(k, Dkp), prep(v, Dvp), group=H // Hkv,
                  block=block, window=int(window), sinks=int(sinks),
                  scale=Dk ** -0.5 if scale is None else float(scale),
                  interpret=bool(interpret))
    return num[:, :T, :, :Dv], row_max[:, :T], row_sum[:, :T]


@functools.partial(jax.jit, static_argnames=(
    "group", "block", "window", "sinks", "scale", "interpret"))
def _swa_call(q, k, v, *, group, block, window, sinks, scale, interpret):
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    sq = pl.squeezed
    return pl.pallas_call(
        functools.partial(_swa_kernel, block=block, window=window, sinks=sinks,
                          scale=scale),
        out_shape=(jax.ShapeDtypeStruct((B, Tp, H, Dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, Tp, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, Tp, H), jnp.float32)),
        grid=(B, H, Tp // block),
        in_specs=[
            pl.BlockSpec((sq, block, sq, Dk), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((sq, Tp, sq, Dk), lambda b, h, i: (b, 0, h // group, 0)),
            pl.BlockSpec((sq, Tp, sq, Dv), lambda b, h, i: (b, 0, h // group, 0)),
        ],
        out_specs=(pl.BlockSpec((sq, block, sq, Dv), lambda b, h, i: (b, i, h, 0)),
                   pl.BlockSpec((sq, block, sq), lambda b, h, i: (b, i, h)),
                   pl.BlockSpec((sq, block, sq), lambda b, h, i: (b, i, h))),
        compiler_params=triton_params(),
        interpret=interpret,
        name="linjax_swa_sinks_fwd",
    )(q, k, v)
