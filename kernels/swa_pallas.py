"""Sink + sliding-window softmax attention as a block-sparse flash kernel in Pallas (Triton
backend), forward and backward.

Query t attends key j iff  j ≤ t  and  (j < sinks  or  t − j < window)  (swa.py's I_t).

Forward: one program per (batch, query head, block of `block` queries). An online softmax
(running max m, normaliser l, fp32 accumulator) visits first the sink key block(s) with the
mask j < sinks, then the key blocks overlapping the window with the mask j ≥ sinks, so every key
counts once: with block 64, the sink block and at most two window blocks for window ≤ 64, and
⌈(64 + window − 1) / 64⌉ + 1 blocks for any window, whatever T is. It writes the normalised
output o, the log-sum-exp lse = m + log l of the scaled scores, the row max m and the key that
attains it (first one on ties).

Backward (FA2): P is recomputed from the saved lse, delta_t = Σ_e dO_te O_te − dlse_t, and
    dS_tj = P_tj (dO_t·v_j − delta_t) + dm_t [j = argmax_t]
(the last term is the row max's own gradient, one-hot like jnp.max's, for swa.SoftmaxParts'
row_max). dq: one program per query block visiting the same key blocks as the forward; it also
writes its block's contribution to the sink keys' dk, dv (every later query sees a sink, so these
are summed over query blocks afterwards instead of looping over all of T in one program). dk, dv:
one program per (query head, key block) over the query blocks whose window reaches it (at most
⌈(64 + window − 1) / 64⌉ + 1), summed over each kv group's query heads afterwards.

Precision: bf16 (or fp16) inputs go into the dots as they are, P and dS are rounded to that dtype
before their dots (as FA2 does), and every dot accumulates in fp32; softmax statistics are fp32.
fp32 inputs run every dot at Precision.HIGHEST, which Triton lowers to IEEE fp32 (not TF32), so
fp32 results match the fp32 reference to ~1e-6.

Masks are applied before the exp with a finite "minus infinity" (no inf − inf); the wrapper pads
T to whole blocks (padded keys lie after every real query, so the causal mask hides them) and
Dk, Dv to powers of two ≥ 16 with zeros.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from linjax.kernels.contract import check_qkv, default_scale
from linjax.kernels.pallas_common import pad_axis, tile_size

BLOCK = 64  # queries and keys per tile
_MASKED = -1e30  # finite stand-in for −inf in masked scores


class _Config(NamedTuple):
    """Static settings of one kernel call (hashable: the custom_vjp's non-differentiable argument)."""

    sinks: int
    window: int
    scale: float
    block: int
    group: int  # query heads per kv head
    interpret: bool
    poison: bool  # outputs start as NaN (ints −1) and must be overwritten: a test/GPU-check switch


# ------------------------------------------------------------ in-kernel pieces


# The dot algorithm per operand dtype: half-precision operands as they are with fp32 accumulation;
# fp32 at HIGHEST, which Triton lowers to IEEE fp32 (its default for fp32 operands is TF32).
_DOT_PRECISION = {jnp.dtype(jnp.bfloat16): lax.DotAlgorithmPreset.BF16_BF16_F32,
                  jnp.dtype(jnp.float16): lax.DotAlgorithmPreset.F16_F16_F32,
                  jnp.dtype(jnp.float32): lax.Precision.HIGHEST}


def _dot(a, b, contract):
    precision = _DOT_PRECISION[jnp.dtype(a.dtype)]
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def _ab(a, b):
    return _dot(a, b, ((1,), (0,)))


def _abt(a, b):
    """a @ bᵀ."""
    return _dot(a, b, ((1,), (1,)))


def _atb(a, b):
    """aᵀ @ b."""
    return _dot(a, b, ((0,), (0,)))


def _rows(ref, start, n):
    return ref[pl.ds(start, n)]


def _sink_mask(t, j, cfg):
    return (j < cfg.sinks) & (j <= t)


def _window_mask(t, j, cfg):
    return (j >= cfg.sinks) & (j <= t) & (t - j < cfg.window)


def _n_sink_blocks(cfg, n_blocks):
    return min(-(-cfg.sinks // cfg.block), n_blocks)


def _first_window_block(q_start, cfg):
    """Oldest key block any query of the block starting at q_start sees in its window (keys ≥ sinks)."""
    return jnp.maximum(jnp.maximum(q_start - cfg.window + 1, cfg.sinks), 0) // cfg.block


def _query_key_iota(q_start, k_start, block):
    t = q_start + lax.broadcasted_iota(jnp.int32, (block, block), 0)
    j = k_start + lax.broadcasted_iota(jnp.int32, (block, block), 1)
    return t, j


# -------------------------------------------------------------------- forward


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, max_ref, arg_ref, *, cfg: _Config):
    block = cfg.block
    i = pl.program_id(2)
    q_start = i * block
    q = q_ref[...]

    def visit(kb, carry, mask):
        m, row_sum, acc, arg = carry
        k_start = kb * block
        t, j = _query_key_iota(q_start, k_start, block)
        keep = mask(t, j, cfg)
        s = jnp.where(keep, _abt(q, _rows(k_ref, k_start, block)) * cfg.scale, _MASKED)
        block_max = jnp.max(s, axis=1)
        block_arg = jnp.min(jnp.where(s == block_max[:, None], j, jnp.iinfo(jnp.int32).max), axis=1)
        arg = jnp.where(block_max > m, block_arg, arg)  # strict: the first key keeps a tie
        m_new = jnp.maximum(m, block_max)
        p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
        rescale = jnp.exp(m - m_new)
        v = _rows(v_ref, k_start, block)
        acc = rescale[:, None] * acc + _ab(p.astype(v.dtype), v)
        return m_new, rescale * row_sum + jnp.sum(p, axis=1), acc, arg

    carry = (jnp.full((block,), _MASKED, jnp.float32), jnp.zeros((block,), jnp.float32),
             jnp.zeros((block, o_ref.shape[-1]), jnp.float32), jnp.full((block,), -1, jnp.int32))
    for kb in range(_n_sink_blocks(cfg, k_ref.shape[0] // block)):
        carry = visit(kb, carry, _sink_mask)
    carry = lax.fori_loop(_first_window_block(q_start, cfg), i + 1,
                          lambda kb, c: visit(kb, c, _window_mask), carry)
    m, row_sum, acc, arg = carry
    # row_sum ≥ 1: every row keeps its diagonal key (t − j = 0 < window), so m is a kept score and adds exp(0).
    o_ref[...] = acc / row_sum[:, None]
    lse_ref[...] = m + jnp.log(row_sum)
    max_ref[...] = m
    arg_ref[...] = arg


def _triton_params(accumulator_width):
    """Launch settings (choosing them picks the Triton backend). Untuned, no GPU was at hand: 8 warps
    once a program's fp32 accumulators have more than 64 columns in all (D 128, or dk and dv at
    D 64), so that they stay in registers."""
    return plgpu.CompilerParams(num_warps=4 if accumulator_width <= 64 else 8, num_stages=2)


def _pallas_call(kernel, inputs, in_specs, out_shapes, out_specs, grid, cfg, name, width):
    """pl.pallas_call on the Triton backend; with cfg.poison the outputs start as NaN (ints −1),
    aliased from extra inputs, so a check can see every element being written."""
    n_in = len(inputs)
    if cfg.poison:
        inputs = [*inputs, *(jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.floating) else -1, s.dtype)
                             for s in out_shapes)]
        in_specs = [*in_specs, *out_specs]
        body = lambda *refs: kernel(*refs[:n_in], *refs[len(inputs):])
        aliases = {n_in + i: i for i in range(len(out_shapes))}
    else:
        body, aliases = kernel, {}
    return pl.pallas_call(
        body, out_shape=tuple(out_shapes), grid=grid, in_specs=in_specs, out_specs=tuple(out_specs),
        input_output_aliases=aliases, compiler_params=_triton_params(width), interpret=cfg.interpret, name=name,
    )(*inputs)


def _whole_sequence(Tp, D, head_of):
    """BlockSpec of one head's whole [Tp, D] (or [Tp] with D None) on grid (batch, head, block)."""
    sq = pl.squeezed
    if D is None:
        return pl.BlockSpec((sq, Tp, sq), lambda b, h, i: (b, 0, head_of(h)))
    return pl.BlockSpec((sq, Tp, sq, D), lambda b, h, i: (b, 0, head_of(h), 0))


def _one_block(block, D):
    """BlockSpec of block i of one head, [block, D] (or [block] with D None)."""
    sq = pl.squeezed
    if D is None:
        return pl.BlockSpec((sq, block, sq), lambda b, h, i: (b, i, h))
    return pl.BlockSpec((sq, block, sq, D), lambda b, h, i: (b, i, h, 0))


def _forward(q, k, v, cfg: _Config):
    """Padded q [B,Tp,H,Dk], k, v [B,Tp,Hkv,·] -> o [B,Tp,H,Dv] fp32, lse, row max [B,Tp,H] fp32,
    argmax key [B,Tp,H] int32."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    kv_head = lambda h: h // cfg.group
    per_row = lambda dtype: jax.ShapeDtypeStruct((B, Tp, H), dtype)
    return _pallas_call(
        functools.partial(_forward_kernel, cfg=cfg), [q, k, v],
        [_one_block(cfg.block, Dk), _whole_sequence(Tp, Dk, kv_head), _whole_sequence(Tp, Dv, kv_head)],
        [jax.ShapeDtypeStruct((B, Tp, H, Dv), jnp.float32), per_row(jnp.float32), per_row(jnp.float32),
         per_row(jnp.int32)],
        [_one_block(cfg.block, Dv)] + [_one_block(cfg.block, None)] * 3,
        (B, H, Tp // cfg.block), cfg, "linjax_swa_sinks_fwd", Dv)


# ------------------------------------------------------------------- backward


def _score_grads(q, do, k, v, t, j, keep, lse, delta, dm, arg, cfg):
    """P and dS of one [query block, key block] tile (fp32), as in the module docstring."""
    s = _abt(q, k) * cfg.scale
    p = jnp.where(keep, jnp.exp(s - lse[:, None]), 0.0)
    dp = _abt(do, v)
    ds = p * (dp - delta[:, None]) + jnp.where(keep & (j == arg[:, None]), dm[:, None], 0.0)
    return p, ds


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dm_ref, arg_ref, dq_ref, *sink_refs,
               cfg: _Config):
    block = cfg.block
    i = pl.program_id(2)
    q_start = i * block
    q, do = q_ref[...], do_ref[...]
    rows = (lse_ref[...], delta_ref[...], dm_ref[...], arg_ref[...])

    def visit(kb, dq, mask):
        k_start = kb * block
        k, v = _rows(k_ref, k_start, block), _rows(v_ref, k_start, block)
        t, j = _query_key_iota(q_start, k_start, block)
        p, ds = _score_grads(q, do, k, v, t, j, mask(t, j, cfg), *rows, cfg)
        return dq + _ab(ds.astype(k.dtype), k), p, ds

    dq = jnp.zeros(q.shape, jnp.float32)
    for kb in range(_n_sink_blocks(cfg, k_ref.shape[0] // block)):
        dq, p, ds = visit(kb, dq, _sink_mask)
        dk_sinks_ref, dv_sinks_ref = sink_refs
        dk_sinks_ref[pl.ds(kb * block, block)] = _atb(ds.astype(q.dtype), q) * cfg.scale
        dv_sinks_ref[pl.ds(kb * block, block)] = _atb(p.astype(do.dtype), do)
    dq = lax.fori_loop(_first_window_block(q_start, cfg), i + 1,
                       lambda kb, dq: visit(kb, dq, _window_mask)[0], dq)
    dq_ref[...] = dq * cfg.scale


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dm_ref, arg_ref, dk_ref, dv_ref, *,
                 cfg: _Config):
    """Window pairs only (keys ≥ sinks); the sink keys' gradients come from the dq programs."""
    block = cfg.block
    kb = pl.program_id(2)
    k_start = kb * block
    k, v = k_ref[...], v_ref[...]
    n_blocks = q_ref.shape[0] // block
    # Query blocks from the diagonal to the last one whose window reaches this block's newest key;
    # none if every key of the block is a sink.
    last = jnp.minimum((k_start + block - 1 + cfg.window - 1) // block, n_blocks - 1)
    stop = jnp.where(k_start + block > cfg.sinks, last + 1, kb)

    def visit(qb, grads):
        dk, dv = grads
        q_start = qb * block
        q, do = _rows(q_ref, q_start, block), _rows(do_ref, q_start, block)
        rows = [_rows(r, q_start, block) for r in (lse_ref, delta_ref, dm_ref, arg_ref)]
        t, j = _query_key_iota(q_start, k_start, block)
        p, ds = _score_grads(q, do, k, v, t, j, _window_mask(t, j, cfg), *rows, cfg)
        return dk + _atb(ds.astype(q.dtype), q), dv + _atb(p.astype(do.dtype), do)

    zeros = lambda ref: jnp.zeros(ref.shape, jnp.float32)
    dk, dv = lax.fori_loop(kb, stop, visit, (zeros(dk_ref), zeros(dv_ref)))
    dk_ref[...] = dk * cfg.scale
    dv_ref[...] = dv


def _backward(q, k, v, do, lse, delta, dm, arg, cfg: _Config):
    """Padded inputs and fp32 cotangent pieces -> fp32 dq [B,Tp,H,Dk], dk, dv per query head
    [B,Tp,H,·] and the sink keys' dk, dv per query block [B,Tp/block,H,S,·] (None without sinks)."""
    B, Tp, H, Dk = q.shape
    Dv = v.shape[3]
    block, n_blocks = cfg.block, Tp // cfg.block
    kv_head = lambda h: h // cfg.group
    same = lambda h: h
    row_inputs = [lse, delta, dm, arg]
    n_sink = _n_sink_blocks(cfg, n_blocks) * block

    sq = pl.squeezed
    sink_spec = lambda D: pl.BlockSpec((sq, sq, sq, n_sink, D), lambda b, h, i: (b, i, h, 0, 0))
    sink_shape = lambda D: jax.ShapeDtypeStruct((B, n_blocks, H, n_sink, D), jnp.float32)
    dq_outs = _pallas_call(
        functools.partial(_dq_kernel, cfg=cfg), [q, k, v, do, *row_inputs],
        [_one_block(block, Dk), _whole_sequence(Tp, Dk, kv_head), _whole_sequence(Tp, Dv, kv_head),
         _one_block(block, Dv)] + [_one_block(block, None)] * 4,
        [jax.ShapeDtypeStruct((B, Tp, H, Dk), jnp.float32)] + ([sink_shape(Dk), sink_shape(Dv)] if n_sink else []),
        [_one_block(block, Dk)] + ([sink_spec(Dk), sink_spec(Dv)] if n_sink else []),
        (B, H, n_blocks), cfg, "linjax_swa_sinks_bwd_dq", Dk)

    key_block = lambda D: pl.BlockSpec((sq, block, sq, D), lambda b, h, i: (b, i, kv_head(h), 0))
    dk, dv = _pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg), [q, k, v, do, *row_inputs],
        [_whole_sequence(Tp, Dk, same), key_block(Dk), key_block(Dv), _whole_sequence(Tp, Dv, same)]
        + [_whole_sequence(Tp, None, same)] * 4,
        [jax.ShapeDtypeStruct((B, Tp, H, Dk), jnp.float32), jax.ShapeDtypeStruct((B, Tp, H, Dv), jnp.float32)],
        [_one_block(block, Dk), _one_block(block, Dv)],
        (B, H, n_blocks), cfg, "linjax_swa_sinks_bwd_dkdv", Dk + Dv)
    return (dq_outs[0], dk, dv, *(dq_outs[1:] if n_sink else (None, None)))


# ----------------------------------------------------------- differentiation


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, cfg: _Config):
    """Padded inputs -> (o fp32, lse, row max), differentiable in all three outputs."""
    return _forward(q, k, v, cfg)[:3]


def _attention_fwd(q, k, v, cfg):
    o, lse, m, arg = _forward(q, k, v, cfg)
    return (o, lse, m), (q, k, v, o, lse, arg)


def _attention_bwd(cfg, residuals, cotangents):
    q, k, v, o, lse, arg = residuals
    do, dlse, dm = (c.astype(jnp.float32) for c in cotangents)
    delta = jnp.sum(do * o, axis=-1) - dlse
    dq, dk, dv, dk_sinks, dv_sinks = _backward(q, k, v, do.astype(v.dtype), lse, delta, dm, arg, cfg)
    if dk_sinks is not None:  # [B, blocks, H, S, D] summed over query blocks, added at positions 0 .. S−1
        S = dk_sinks.shape[3]
        dk = dk.at[:, :S].add(jnp.swapaxes(dk_sinks.sum(1), 1, 2))
        dv = dv.at[:, :S].add(jnp.swapaxes(dv_sinks.sum(1), 1, 2))
    B, Tp, H = q.shape[:3]
    group_sum = lambda x: x.reshape(B, Tp, H // cfg.group, cfg.group, x.shape[-1]).sum(3)
    return dq.astype(q.dtype), group_sum(dk).astype(k.dtype), group_sum(dv).astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _run(q, k, v, *, sinks, window, scale, block, interpret, poison=False):
    """Checks, pads, runs `_attention`; returns (o fp32, lse, row max), each cut back to [B, T, H, ...]."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    if T == 0:
        raise ValueError("sequence length T must be at least 1")
    if window < 1 or sinks < 0:
        raise ValueError(f"need window ≥ 1 and sinks ≥ 0; got window={window}, sinks={sinks}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block (the window kernel's chunk) must be a power of two ≥ 16; got {block}")
    dtype = jnp.result_type(q, k, v)
    if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q, k, v must be float32, bfloat16 or float16; got {dtype}")
    Tp = -(-T // block) * block
    prep = lambda x, d: pad_axis(pad_axis(x.astype(dtype), 1, Tp), 3, d)
    cfg = _Config(int(sinks), int(window), float(default_scale(scale, Dk)), block, H // Hkv, bool(interpret),
                  bool(poison))
    o, lse, row_max = _attention(prep(q, tile_size(Dk)), prep(k, tile_size(Dk)), prep(v, tile_size(Dv)), cfg)
    return o[:, :T, :, :Dv], lse[:, :T], row_max[:, :T]


# ------------------------------------------------------------------ public


def sinks_window_attention(q, k, v, *, sinks: int, window: int, scale=None, block: int = BLOCK,
                           interpret: bool = False):
    """Softmax attention of each query over the first `sinks` keys and the `window` most recent ones
    (itself included), as one Pallas flash kernel; differentiable (`jax.grad`) in q, k, v through both
    outputs.

    q [B,T,H,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv] (H a multiple of Hkv; query head h reads kv head
    h // (H // Hkv)); scale defaults to Dk^-1/2. Returns o [B,T,H,Dv] in v's dtype and the
    log-sum-exp of the scaled scores, lse [B,T,H] fp32. interpret=True runs the Pallas interpreter
    (CPU); False compiles with Triton (GPU).
    """
    o, lse, _ = _run(q, k, v, sinks=sinks, window=window, scale=scale, block=block, interpret=interpret)
    return o.astype(v.dtype), lse


def softmax_parts(q, k, v, *, sinks: int, window: int, scale=None, block: int = BLOCK,
                  interpret: bool = False, poison: bool = False):
    """The same attention as swa.SoftmaxParts' fields (numerator [B,T,H,Dv], row_max, row_sum [B,T,H],
    fp32), differentiable in all three: numerator and row_sum are o and exp(lse − row_max) rescaled,
    row_max has the one-hot gradient of a max. poison=True starts every kernel output as NaN (a check
    that the kernels write all of them)."""
    o, lse, row_max = _run(q, k, v, sinks=sinks, window=window, scale=scale, block=block, interpret=interpret,
                           poison=poison)
    row_sum = jnp.exp(lse - row_max)
    return o * row_sum[..., None], row_max, row_sum
