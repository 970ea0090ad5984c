"""Softmax attention over sink tokens plus a sliding window, and the shifted linear term beside it.

The paper's final recipe (sec. 4, "Adding Sliding Window Attention"):

    y_t = q_t S_{s:t-w} + y_t^swa,   y_t^swa = softmax attention of q_t over I_t,
    I_t = { j ≤ t : j < s  or  t − j < w }      (s sinks, w window; 0-based positions)

so every past position reaches y_t exactly once: through exact softmax if it
is a sink or one of the w most recent tokens, otherwise through the linear
state. This module has the softmax part and the input shift for the linear
part; the mixer adds the two.

Softmax part (GQA as in contract.py: query head h reads kv head h // (H // Hkv)):

    reference(q, k, v, *, sinks, window, scale=None) -> SoftmaxParts     # dense [T, T] mask, tests only
    chunked(q, k, v, *, sinks, window, scale=None, chunk=CHUNK, cache=None) -> SoftmaxParts
    prefill(q, k, v, cache, *, scale=None, chunk=CHUNK) -> (SoftmaxParts, new_cache)
    step(q, k, v, cache, *, scale=None) -> (SoftmaxParts, new_cache)   # q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv]
    leaving_window(rings, length, *, sinks) -> linear inputs of the token leaving the window (decode)
    empty_cache(batch, kv_heads, key_dim, value_dim, *, sinks, window, dtype) -> WindowCache
    update_cache(cache, k, v) -> WindowCache
    softmax_blocks([(scores, mask, weigh_values), ...]) -> (numerator, row_max, row_sum)   # disjoint key blocks

The decode state after a prefill is `prefill(q, k, v, empty_cache(...))[1]`
(or `update_cache(empty_cache(...), k, v)` when the prefill ran `chunked`).

SoftmaxParts keeps the statistics unnormalised (fp32) so a mixer can add a
linear term with or without a shared normaliser:
    o = numerator / row_sum                      (parts.normalized())
    GLA/GDN/kGLA: y = linear_o + parts.normalized()
    Hedgehog (one normaliser, as LoLCATs): y = (numerator + lin_num) / (row_sum + lin_den),
      which weights the linear term like exp(score − row_max); the exact
      unshifted sum would be (numerator + e^{−row_max} lin_num) / (row_sum + e^{−row_max} lin_den).

Linear part: `shifted_linear_inputs` (bottom of the file).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linjax.kernels import scaling, swa_pallas
from linjax.kernels.contract import as_token_batch, check_qkv, default_scale
from linjax.kernels.pallas_common import by_platform

# Default query block of `chunked`, `prefill` and `pallas`. A block attends to itself and the
# ⌈window / chunk⌉ blocks before it, so with the paper's budget (window 56 or 64) a 64-query block
# reads 128 keys, about twice the keys it needs; the Pallas kernel uses the same block as its
# power-of-two tile.
CHUNK = 64

_MASKED = -1e30  # finite "−inf": a row's max stays finite, exp(_MASKED − max) = 0


class SoftmaxParts(NamedTuple):
    """Unnormalised softmax attention over I_t, fp32. numerator [..., H, Dv]; row_max, row_sum [..., H]."""

    numerator: jax.Array  # Σ_{j∈I_t} exp(s_tj − m_t) v_j
    row_max: jax.Array  # m_t = max_{j∈I_t} s_tj,  s_tj = scale · q_t·k_j
    row_sum: jax.Array  # Σ_{j∈I_t} exp(s_tj − m_t)

    def normalized(self):
        # a scaling whose gradient is a matrix-vector product, not an XLA:CPU reduction (scaling.py)
        return scaling.scale_rows(1.0 / self.row_sum, self.numerator)


class WindowCache(NamedTuple):
    """Decode state: the first `sinks` keys/values in slots, the last `window` in a ring, and the tokens seen.

    sink_k [B,sinks,Hkv,Dk], sink_v [B,sinks,Hkv,Dv]: slot j holds position j (once seen).
    ring_k [B,window,Hkv,Dk], ring_v [B,window,Hkv,Dv]: slot r holds the latest position p ≡ r (mod window).
    length: int32 scalar, tokens seen so far (= position of the next token), the counter every decode
    state has (linjax/mixers/states.py).
    Every token is written to the ring, sinks too; the attention mask skips ring
    entries at positions < sinks (they are read from the sink slots).
    """

    sink_k: jax.Array
    sink_v: jax.Array
    ring_k: jax.Array
    ring_v: jax.Array
    length: jax.Array

    @property
    def sinks(self):
        return self.sink_k.shape[1]

    @property
    def window(self):
        return self.ring_k.shape[1]


def _check_budget(sinks, window):
    if sinks < 0 or window < 1:
        raise ValueError(f"need sinks >= 0 and window >= 1 (the current token is always in the window); "
                         f"got sinks={sinks}, window={window}")


def softmax_blocks(scores_and_values):
    """One softmax over several disjoint key blocks, as (numerator, row_max, row_sum) sharing one row max.
    Each block: (scores [..., q, j], mask, a function of the probabilities giving their values-weighted sum).
    The dense spec, the ring-buffer decode and the retained-token blocks (linjax.mixers.sinks_window) use it."""
    scores_and_values = [block for block in scores_and_values if block[0].shape[-1] > 0]  # e.g. no sinks
    masked = [jnp.where(mask, s, _MASKED) for s, mask, _ in scores_and_values]
    row_max = jnp.max(jnp.stack([m.max(axis=-1) for m in masked]), axis=0)
    numerator, row_sum = 0.0, 0.0
    for m, (_, mask, weigh_values) in zip(masked, scores_and_values):
        p = jnp.where(mask, jnp.exp(m - row_max[..., None]), 0.0)
        row_sum = row_sum + scaling.row_sums(p)
        numerator = numerator + weigh_values(p)
    return numerator, row_max, row_sum


# ------------------------------------------------------------------ dense spec


def reference(q, k, v, *, sinks, window, scale=None):
    """Dense softmax with the sink + window mask over the whole [T, T] score matrix (the spec; tests only)."""
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    _check_budget(sinks, window)
    scale = default_scale(scale, Dk)
    G = H // Hkv
    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dk)
    scores = scale * jnp.einsum("btkgd,bjkd->bkgtj", qg, k.astype(jnp.float32))
    t = jnp.arange(T)[:, None]
    j = jnp.arange(T)[None, :]
    mask = (j <= t) & ((j < sinks) | (t - j < window))
    numerator, row_max, row_sum = softmax_blocks(
        [(scores, mask, lambda p: jnp.einsum("bkgtj,bjke->bkgte", p, v.astype(jnp.float32)))])
    heads_last = lambda x: jnp.moveaxis(x.reshape(B, H, T, *x.shape[4:]), 1, 2)  # [B,Hkv,G,T,..] -> [B,T,H,..]
    return SoftmaxParts(heads_last(numerator), heads_last(row_max), heads_last(row_sum))


# ---------------------------------------------------------------- ring buffer


def empty_cache(batch, kv_heads, key_dim, value_dim, *, sinks, window, dtype=jnp.float32):
    """A fresh WindowCache (nothing seen)."""
    _check_budget(sinks, window)
    zeros = lambda n, d: jnp.zeros((batch, n, kv_heads, d), dtype)
    return WindowCache(zeros(sinks, key_dim), zeros(sinks, value_dim), zeros(window, key_dim),
                       zeros(window, value_dim), jnp.zeros((), jnp.int32))


def unroll_ring(ring, length):
    """Ring [B,W,...] -> the same entries in position order: entry e holds position length − W + e.

    Entries at positions < 0 were never written (zeros). Works for any ring
    written with `write_ring` (a mixer may keep its own rings, e.g. of gates).
    """
    W = ring.shape[1]
    return jnp.take(ring, (jnp.arange(W) + length) % W, axis=1)


def write_ring(ring, x, length):
    """Write x [B,T,...] (positions length .. length+T−1) into ring [B,W,...]: slot r gets the latest p ≡ r mod W."""
    W = ring.shape[1]
    if x.shape[1] == 1:  # decode: one slot, updated in place when the state is donated
        return jax.lax.dynamic_update_slice_in_dim(ring, x.astype(ring.dtype), length % W, axis=1)
    latest = jnp.concatenate([unroll_ring(ring, length), x.astype(ring.dtype)], axis=1)[:, -W:]
    return jnp.take(latest, (jnp.arange(W) - (length + x.shape[1])) % W, axis=1)


def _write_sinks(slots, x, length):
    """Sink slots [B,S,...] with positions length .. length+T−1 of x [B,T,...] written where < S."""
    S, T = slots.shape[1], x.shape[1]
    offset = jnp.arange(S) - length
    fresh = (offset >= 0) & (offset < T)
    taken = jnp.take(x, jnp.clip(offset, 0, T - 1), axis=1).astype(slots.dtype)
    return jnp.where(fresh.reshape((1, S) + (1,) * (x.ndim - 2)), taken, slots)


def update_cache(cache, k, v):
    """The cache after also seeing k [B,T,Hkv,Dk], v [B,T,Hkv,Dv] (any T ≥ 1)."""
    c = cache.length
    return WindowCache(_write_sinks(cache.sink_k, k, c), _write_sinks(cache.sink_v, v, c),
                       write_ring(cache.ring_k, k, c), write_ring(cache.ring_v, v, c),
                       c + jnp.asarray(k.shape[1], jnp.int32))


# ------------------------------------------------------------ blocked, linear in T


def chunked(q, k, v, *, sinks, window, scale=None, chunk=CHUNK, cache=None):
    """Sink + sliding-window softmax in query blocks of `chunk`: each block sees its own block, the
    ⌈window/chunk⌉ blocks before it and the sink keys, so memory and work are O(T · (chunk + window + sinks)).

    With `cache`, the queries sit at positions cache.length .. cache.length+T−1 and
    also see the cached sinks and ring (a prefill split anywhere equals one pass).
    Returns SoftmaxParts [B,T,H,...] (fp32).
    """
    B, T, H, Hkv, Dk, Dv = check_qkv(q, k, v)
    _check_budget(sinks, window)
    if T == 0:
        raise ValueError("swa.chunked needs at least one token (T = 0)")
    scale = default_scale(scale, Dk)
    G = H // Hkv
    f32 = lambda x: x.astype(jnp.float32)
    q, k, v = f32(q), f32(k), f32(v)
    if cache is None:
        start = 0
        history_k = history_v = None
        pad_sinks = lambda x: jnp.pad(x[:, :sinks], ((0, 0), (0, max(sinks - T, 0)), (0, 0), (0, 0)))
        sink_k, sink_v = pad_sinks(k), pad_sinks(v)
    else:
        if (cache.sinks, cache.window) != (sinks, window) or cache.ring_k.shape[2:] != (Hkv, Dk):
            raise ValueError(f"cache holds sinks={cache.sinks}, window={cache.window}, kv heads × dim "
                             f"{cache.ring_k.shape[2:]}; the call asks sinks={sinks}, window={window}, {(Hkv, Dk)}")
        start = cache.length
        history_k, history_v = f32(unroll_ring(cache.ring_k, start)), f32(unroll_ring(cache.ring_v, start))
        sink_k, sink_v = f32(_write_sinks(cache.sink_k, k, start)), f32(_write_sinks(cache.sink_v, v, start))

    # Key sequence = [history (h = 0 or window entries), new keys], left-padded so that query block i
    # sees padded key blocks i .. i+before: position(key slot j of block i) = start + i·C + j − before·C.
    C = min(chunk, T)
    N = math.ceil(T / C)
    before = math.ceil(window / C)
    h = 0 if history_k is None else window
    left = before * C - h

    span = (before + 1) * C
    gather = (jnp.arange(N) * C)[:, None] + jnp.arange(span)[None, :]  # [N, span] into the padded keys

    def key_blocks(x, history):  # -> [B, N, span, Hkv, D]
        x = x if history is None else jnp.concatenate([history, x], axis=1)
        x = jnp.pad(x, ((0, 0), (left, N * C - T), (0, 0), (0, 0)))
        return jnp.take(x, gather.reshape(-1), axis=1).reshape(B, N, span, Hkv, x.shape[-1])

    qb = jnp.pad(q, ((0, 0), (0, N * C - T), (0, 0), (0, 0))).reshape(B, N, C, Hkv, G, Dk)
    kb, vb = key_blocks(k, history_k), key_blocks(v, history_v)

    query_pos = start + (jnp.arange(N) * C)[:, None, None] + jnp.arange(C)[None, :, None]  # [N, C, 1]
    key_pos = start + gather[:, None, :] - before * C
    in_window = (key_pos <= query_pos) & (query_pos - key_pos < window) & (key_pos >= sinks)  # [N, C, K]
    sink_seen = jnp.arange(sinks)[None, None, :] <= query_pos  # [N, C, sinks]

    def query_block(x):  # one block of C queries against its span of keys and the sinks
        qb, kb, vb, in_window, sink_seen = x
        window_scores = scale * jnp.einsum("bqkgd,bjkd->bkgqj", qb, kb)
        sink_scores = scale * jnp.einsum("bqkgd,bskd->bkgqs", qb, sink_k)
        return softmax_blocks([
            (window_scores, in_window[None, None, None], lambda p: jnp.einsum("bkgqj,bjke->bkgqe", p, vb)),
            (sink_scores, sink_seen[None, None, None], lambda p: jnp.einsum("bkgqs,bske->bkgqe", p, sink_v)),
        ])

    # One query block per step of a loop, recomputed in the backward: a block's scores and
    # probabilities ([B, Hkv, G, C, span], under 0.3 MB at SmolLM2's shapes) stay in cache between
    # the passes over them. Forming all blocks at once made every pass stream the whole [.., T, span]
    # array, and the cost grew faster than T.
    blocks_first = lambda x: jnp.moveaxis(x, 1, 0)
    blocks = (blocks_first(qb), blocks_first(kb), blocks_first(vb), in_window, sink_seen)
    numerator, row_max, row_sum = jax.lax.map(jax.checkpoint(query_block), blocks)
    # [N,B,Hkv,G,C,...] -> [B,T,H,...]
    to_bthd = lambda x: jnp.moveaxis(x, (0, 4), (1, 2)).reshape(B, N * C, H, *x.shape[5:])[:, :T]
    return SoftmaxParts(to_bthd(numerator), to_bthd(row_max), to_bthd(row_sum))


def prefill(q, k, v, cache, *, scale=None, chunk=CHUNK):
    """Attend a block of new tokens after `cache` and return (SoftmaxParts, cache after them)."""
    parts = chunked(q, k, v, sinks=cache.sinks, window=cache.window, scale=scale, chunk=chunk, cache=cache)
    return parts, update_cache(cache, k, v)


def step(q, k, v, cache, *, scale=None):
    """One decode token (q [B,H,Dk], k [B,Hkv,Dk], v [B,Hkv,Dv]) against the ring buffer: O(sinks + window)."""
    B, _, H, Hkv, Dk, Dv = as_token_batch(q, k, v)
    scale = default_scale(scale, Dk)
    G = H // Hkv
    t = cache.length
    cache = update_cache(cache, k[:, None], v[:, None])
    W, S = cache.window, cache.sinks
    ring_pos = t - (t - jnp.arange(W)) % W  # position held by each ring slot
    qg = q.astype(jnp.float32).reshape(B, Hkv, G, Dk)
    f32 = lambda x: x.astype(jnp.float32)
    ring_scores = scale * jnp.einsum("bkgd,brkd->bkgr", qg, f32(cache.ring_k))
    sink_scores = scale * jnp.einsum("bkgd,bskd->bkgs", qg, f32(cache.sink_k))
    numerator, row_max, row_sum = softmax_blocks([
        (ring_scores, ring_pos >= S, lambda p: jnp.einsum("bkgr,brke->bkge", p, f32(cache.ring_v))),
        (sink_scores, jnp.arange(S) <= t, lambda p: jnp.einsum("bkgs,bske->bkge", p, f32(cache.sink_v))),
    ])
    return SoftmaxParts(numerator.reshape(B, H, Dv), row_max.reshape(B, H), row_sum.reshape(B, H)), cache


# ------------------------------------------------------------ shifted linear term


def shifted_linear_inputs(k, v, *gates, sinks, window, history=None, start=0):
    """Inputs for a linear kernel whose state at t is S_{s:t−w}: positions sinks .. t−window only.

    Index algebra. The linear kernels compute S'_t = A'_t S'_{t−1} + (k'_t, v'_t)
    (A' the decay from the gates at t, e.g. Diag(α'_t) for GLA) and read y_t = q_t S'_t.
    Feeding entry t' the token at position t' − w,

        k'_t' = k_{t'−w} · [t' − w ≥ s],  v'_t' = v_{t'−w},  gates'_t' = gates_{t'−w}

    (zeros for t' < w) gives by induction
        S'_t = Σ_{s ≤ j ≤ t−w} (A_{t−w} ⋯ A_{j+1}) k_j v_jᵀ = S_{s:t−w}:
    position j enters when t' = j + w, and from then on it decays by A'_{t'} =
    A_{t'−w}, i.e. by the original gates of the positions j+1 .. t−w between
    it and t − w — the decay of the unshifted recurrence stopped at t − w.
    Together with I_t = {j ≤ t : j < s or j > t − w} each j ≤ t is covered once.

    Sinks are removed by zeroing their key, which removes them from every
    mechanism here: k vᵀ (GLA, kGLA), z += k (Hedgehog, whose [v, 1] trick
    would keep a zeroed v), β k kᵀ and β k vᵀ (delta rule). Their gates (and a
    key-dependent kGLA gate, which becomes log α) only decay a state that holds
    nothing yet, since all earlier positions are sinks as well.

    k [B,T,Hkv,Dk], v [B,T,Hkv,Dv], gates: any arrays [B,T,...] (log α, β, ...),
    all shifted along time. For a block that continues a sequence at position
    `start`, `history` gives (k, v, *gates) of positions start−w .. start−1 in
    order, each [B, window, ...] (e.g. `unroll_ring(cache.ring_k, start)`; a
    mixer keeps the gates it needs in its own ring with `write_ring`) and the
    kernel's initial state is the previous block's final state. For decode,
    call it with T = 1: the entry is the token leaving the window.
    """
    arrays = (k, v, *gates)
    T = k.shape[1]
    for x in arrays:
        if x.shape[:2] != k.shape[:2]:
            raise ValueError(f"every input must be [B, T, ...] with [B, T] = {k.shape[:2]}; got {x.shape}")
    if history is None:
        history = tuple(jnp.zeros((x.shape[0], window) + x.shape[2:], x.dtype) for x in arrays)
    elif len(history) != len(arrays) or any(hx.shape != (x.shape[0], window) + x.shape[2:]
                                           for hx, x in zip(history, arrays)):
        raise ValueError(f"history must be one [B, window={window}, ...] array per input (k, v, *gates); got "
                         f"{[tuple(hx.shape) for hx in history]}")
    shifted = [jnp.concatenate([hx.astype(x.dtype), x], axis=1)[:, :T] for hx, x in zip(history, arrays)]
    source = start - window + jnp.arange(T)  # position of each shifted entry
    keep = (source >= sinks).reshape((1, T) + (1,) * (k.ndim - 2))
    shifted[0] = jnp.where(keep, shifted[0], jnp.zeros((), k.dtype))
    return tuple(shifted)


def leaving_window(rings, length, *, sinks):
    """Decode form of `shifted_linear_inputs` for the one token at position `length`: the linear inputs
    (k', v', *gates) of position length − window, which leaves the window now, read from the rings the
    mixer keeps with `write_ring` (slot length mod window; zeros before the sequence starts), the key
    zeroed if that position is a sink. Equals shifted_linear_inputs(..., history=unrolled rings, start=length)
    with T = 1, without unrolling (copying) every ring at every step. Returns [B, 1, ...] arrays."""
    window = rings[0].shape[1]
    entries = [jax.lax.dynamic_slice_in_dim(ring, length % window, 1, axis=1) for ring in rings]
    entries[0] = jnp.where(length - window >= sinks, entries[0], jnp.zeros((), entries[0].dtype))
    return tuple(entries)


# ------------------------------------------------------------------ Pallas (GPU)


def pallas(q, k, v, *, sinks, window, scale=None, chunk=CHUNK, cache=None, interpret=None):
    """`chunked` as a block-sparse flash kernel in Pallas (Triton), forward and backward (swa_pallas.py):
    same arguments and SoftmaxParts, differentiable in all three parts (`jax.custom_vjp` with
    backward kernels of the same block-sparse shape). `chunk` is the kernel's query and key block
    (a power of two ≥ 16). bf16 inputs: bf16 dots accumulating in fp32; fp32 inputs: IEEE fp32
    dots. interpret=None: compiled where the program is lowered for a GPU, interpreted on a CPU. Continuing
    after a `cache` (prefill) is not in the kernel: use `chunked` or `prefill` for that."""
    if cache is not None:
        raise NotImplementedError("swa.pallas attends from position 0 only; for a prefill after a "
                                  "cache use swa.prefill / swa.chunked(..., cache=cache)")
    _check_budget(sinks, window)
    def run(q, k, v, *, interpret):
        return swa_pallas.softmax_parts(q, k, v, sinks=sinks, window=window, scale=scale, block=chunk,
                                        interpret=interpret)
    return SoftmaxParts(*by_platform(run, q, k, v, interpret=interpret))
