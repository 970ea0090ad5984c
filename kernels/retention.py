"""A fixed number of past tokens kept for their content, beside the sinks and the window (docs/retention.md).

The paper names the step it did not take: "combining GDN with content-aware token
retention to improve multi-item retrieval under a fixed cache budget" (sec. 6; LoLA
and STILL keep extra tokens by content). With R retained slots per kv head, the
softmax part of the final recipe runs over

    I_t = sinks ∪ window ∪ R_t,

R_t the tokens that scored highest when they left the window. A token leaving the
window is a candidate: it takes a slot if one is empty or if its score is above
the lowest score held (ties keep the older token); the token that loses its slot,
or the candidate that is not admitted, is written into the linear state at that
step, as the leaving token is without retention. So every past token is in exactly
one of sinks, window, retained slots or state.

Pure functions, one kv head's slots independent of another's:

    empty(batch, retain, entries) -> RetainedCache        entries: one token's arrays [B, Hkv or H, ...]
    admit(cache, candidate, score, position, valid) -> (cache, written, written_valid)
    select(cache, candidates, score, position, valid) -> (cache, written, written_valid)
                                                          C tokens at once (`retain_block`)
    attend(q, cache, scale) -> SoftmaxParts               the retained keys' share of the softmax
    merge(a, b) -> SoftmaxParts                           two parts over disjoint keys as one
    key_norm(k) -> scores                                 ‖k‖ of the pretrained key
    recall_error(state, k, v, log_alpha, normalized) -> scores   LoLA's ‖v − Sᵀk‖ / ‖v‖, now
    received_mass(scores, mask, row_max, row_sum) -> mass   the softmax probability keys received

The scores (`SCORES`, the setting `retain_score`):

    "recall"     recall_error against the state the token would enter; the retained tokens
                 re-scored at every step against the current state
    "key_norm"   ‖k‖ of the pretrained key, fixed at admission
    "attention"  the attention mass the token received while it was in the window (H2O /
                 SnapKV-style), fixed at admission: the sum over the queries that saw it in the
                 window of its probability in their joint softmax over sinks ∪ window ∪ retained,
                 averaged over the query heads of its kv head. SinksWindow keeps the running sums
                 (`SinksWindowCache.mass`, adding `received_mass` after every query) and reads
                 them when the token leaves (`SinksWindow.leaving_mass`).

An entry is every array that travels with a token into a slot: the pretrained k and
v the softmax reads, and the linear inputs (k', v', gates) written into the state if
it is evicted. Arrays per kv head are [B, Hkv, ...]; per query head [B, H, ...]
(H = G · Hkv, query head h belongs to kv head h // G, as contract.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from linjax.kernels.contract import default_scale, expand_kv_heads
from linjax.kernels.swa import SoftmaxParts

SCORES = ("recall", "key_norm", "attention")

_MASKED = -1e30  # as swa._MASKED: a finite "−inf" keeps the row max finite


class RetainedCache(NamedTuple):
    """R slots per kv head. entries: arrays [B, R, Hkv or H, ...] (see the module docstring);
    score [B, R, Hkv] fp32 (−inf where empty); position [B, R, Hkv] int32 (−1 where empty)."""

    entries: tuple
    score: jax.Array
    position: jax.Array

    @property
    def retain(self) -> int:
        return self.score.shape[1]


def empty(batch: int, retain: int, kv_heads: int, entries: tuple) -> RetainedCache:
    """No token retained yet. `entries`: one token's arrays (or their shapes) [B, heads, ...]."""
    slots = tuple(jnp.zeros((batch, retain) + tuple(e.shape[1:]), e.dtype) for e in entries)
    return RetainedCache(slots, jnp.full((batch, retain, kv_heads), -jnp.inf, jnp.float32),
                         jnp.full((batch, retain, kv_heads), -1, jnp.int32))


def _per_heads(index, heads: int):
    """A slot index per kv head [B, Hkv] as one per `heads` (Hkv, or H query heads of G per kv head)."""
    return jnp.repeat(index, heads // index.shape[1], axis=1)


def _take_slot(slots, index):
    """slots [B, R, heads, ...], index [B, heads] -> [B, heads, ...], the slot each head names."""
    index = _per_heads(index, slots.shape[2])
    index = index.reshape(index.shape[:1] + (1,) + index.shape[1:] + (1,) * (slots.ndim - 3))
    return jnp.take_along_axis(slots, index, axis=1)[:, 0]


def _put_slot(slots, index, value, where):
    """slots with slot index[b, h] of head h set to value [B, heads, ...] where `where` [B, Hkv]."""
    heads = slots.shape[2]
    hit = jnp.arange(slots.shape[1])[None, :, None] == _per_heads(index, heads)[:, None, :]  # [B, R, heads]
    hit = hit & _per_heads(where, heads)[:, None, :]
    hit = hit.reshape(hit.shape + (1,) * (slots.ndim - 3))
    return jnp.where(hit, value[:, None].astype(slots.dtype), slots)


def _expand_to(mask, x):
    """mask [B, heads] with trailing axes of one to broadcast against x [B, heads, ...]."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - 2))


def _weakest_slot(cache: RetainedCache):
    """[B, Hkv] the slot a candidate competes with: the lowest score, among equal scores the newest
    token (so ties keep the older), among empty slots the first."""
    score, position = cache.score, cache.position
    lowest = score == jnp.min(score, axis=1, keepdims=True)
    newest_lowest = jnp.where(lowest, position, jnp.iinfo(jnp.int32).min)
    return jnp.argmax(lowest & (position == jnp.max(newest_lowest, axis=1, keepdims=True)), axis=1)


def admit(cache: RetainedCache, candidate: tuple, score, position, valid):
    """One token leaving the window, per kv head: (cache after it, the entry written into the state,
    whether that entry is a token).

    candidate: the token's entries [B, heads, ...] in `cache.entries` order; score [B, Hkv]; position:
    its position ([] int32); valid [] or [B, Hkv] bool: False when no token leaves (t < window) or
    the leaving one is a sink, which is already kept. A valid candidate is admitted when a slot is
    empty or its score is above the weakest slot's (`_weakest_slot`); then the token it replaces (if
    any) is written, else the candidate itself.
    """
    score = score.astype(jnp.float32)
    valid = jnp.broadcast_to(valid, score.shape)
    slot = _weakest_slot(cache)
    held_score = jnp.take_along_axis(cache.score, slot[:, None], axis=1)[:, 0]
    held_position = jnp.take_along_axis(cache.position, slot[:, None], axis=1)[:, 0]
    admitted = valid & (score > held_score)
    held = tuple(_take_slot(slots, slot) for slots in cache.entries)
    written = tuple(jnp.where(_expand_to(_per_heads(admitted, h.shape[1]), h), h, c.astype(h.dtype))
                    for h, c in zip(held, candidate))
    written_valid = jnp.where(admitted, held_position >= 0, valid)
    new = RetainedCache(
        tuple(_put_slot(slots, slot, c, admitted) for slots, c in zip(cache.entries, candidate)),
        _put_slot(cache.score, slot, score, admitted),
        _put_slot(cache.position, slot, jnp.broadcast_to(position, score.shape), admitted))
    return new, written, written_valid


def _gather_slots(arrays, index):
    """arrays [B, N, heads, ...], index [B, M, Hkv] (per kv head) -> [B, M, heads, ...]."""
    heads = arrays.shape[2]
    index = jnp.repeat(index, heads // index.shape[2], axis=2)
    return jnp.take_along_axis(arrays, index.reshape(index.shape + (1,) * (arrays.ndim - 3)), axis=1)


def select(cache: RetainedCache, candidates: tuple, score, position, valid):
    """C tokens leaving the window at once (a block boundary, `retain_block` = C), per kv head: the R
    held tokens and the C candidates compete, the R best are kept (higher score first, among equal
    scores the older token, empty or invalid never before a token), and the C others are written.

    candidates: entries [B, C, heads, ...] in `cache.entries` order; score [B, C, Hkv] (the held
    tokens' scores are `cache.score`: re-score them first, as `admit`'s caller does); position [B, C]
    or [B, C, Hkv]; valid [B, C, Hkv] bool (False: no token, or a sink). Returns (cache after, the
    written entries [B, C, heads, ...] in position order with the non-tokens last, written_valid
    [B, C, Hkv]).
    """
    held = cache.position >= 0
    pool_valid = jnp.concatenate([held, valid], axis=1)  # [B, R + C, Hkv]
    pool_score = jnp.where(pool_valid, jnp.concatenate([cache.score, score.astype(jnp.float32)], axis=1),
                           -jnp.inf)
    position = jnp.broadcast_to(position.reshape(position.shape[:2] + (-1,)), valid.shape).astype(jnp.int32)
    pool_position = jnp.concatenate([cache.position, position], axis=1)
    # rank: tokens first, then by score (high first), then by position (old first)
    order = jnp.lexsort((pool_position, -pool_score, ~pool_valid), axis=1)
    R = cache.retain
    kept, rest = order[:, :R], order[:, R:]
    take = lambda a, index: jnp.take_along_axis(a, index, axis=1)
    # the written ones in position order, non-tokens last
    rest_valid, rest_position = take(pool_valid, rest), take(pool_position, rest)
    rest = take(rest, jnp.lexsort((rest_position, ~rest_valid), axis=1))
    pool = tuple(jnp.concatenate([held_slots, c.astype(held_slots.dtype)], axis=1)
                 for held_slots, c in zip(cache.entries, candidates))
    kept_valid = take(pool_valid, kept)
    new = RetainedCache(tuple(_gather_slots(a, kept) for a in pool),
                        jnp.where(kept_valid, take(pool_score, kept), -jnp.inf),
                        jnp.where(kept_valid, take(pool_position, kept), -1))
    return new, tuple(_gather_slots(a, rest) for a in pool), take(pool_valid, rest)


def attend(q, k, v, position, *, scale=None) -> SoftmaxParts:
    """The retained tokens' softmax parts for one query token. q [B, H, Dk]; k, v [B, R, Hkv, D]
    (the slots' pretrained keys and values); position [B, R, Hkv] (−1: empty, masked)."""
    B, H, Dk = q.shape
    Hkv = k.shape[2]
    scale = default_scale(scale, Dk)
    qg = q.astype(jnp.float32).reshape(B, Hkv, H // Hkv, Dk)
    scores = scale * jnp.einsum("bkgd,brkd->bkgr", qg, k.astype(jnp.float32))
    held = jnp.moveaxis(position >= 0, 1, 2)[:, :, None, :]  # [B, Hkv, 1, R]
    masked = jnp.where(held, scores, _MASKED)
    row_max = masked.max(axis=-1)
    p = jnp.where(held, jnp.exp(masked - row_max[..., None]), 0.0)
    numerator = jnp.einsum("bkgr,brke->bkge", p, v.astype(jnp.float32))
    return SoftmaxParts(numerator.reshape(B, H, -1), row_max.reshape(B, H), p.sum(-1).reshape(B, H))


def merge(a: SoftmaxParts, b: SoftmaxParts) -> SoftmaxParts:
    """One softmax over the union of two disjoint key sets, from each set's parts."""
    row_max = jnp.maximum(a.row_max, b.row_max)
    wa, wb = jnp.exp(a.row_max - row_max), jnp.exp(b.row_max - row_max)
    return SoftmaxParts(a.numerator * wa[..., None] + b.numerator * wb[..., None], row_max,
                        a.row_sum * wa + b.row_sum * wb)


def key_norm(k):
    """‖k‖ per kv head of the pretrained (post-RoPE) key, k [B, Hkv, Dk] -> [B, Hkv]: tokens with large
    keys draw attention wherever they are; the cheap score, no state needed."""
    k = k.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(k * k, axis=-1))


def recall_error(state, k, v, log_alpha=None, *, normalized: bool = False, eps: float = 1e-6):
    """LoLA's self-recall error of tokens against the state they would enter now, per kv head [B, N, Hkv]:

        ‖v − Sᵀk‖ / ‖v‖,   S = Diag(α) S_prev (the decay of this step applied first, as the delta rule does)

    averaged over the query heads of each kv head (each has its own state). A token the state already
    reproduces loses little by being written into it; one it cannot reproduce is worth a slot.
    state [B, H, Dk', Dv'] fp32; k [B, N, Hkv, Dk'], v [B, N, Hkv, Dv] the linear inputs of N tokens;
    log_alpha [B, H, Dk'], [B, H] or None. `normalized` (Hedgehog's [v, 1] state): the readout
    Sᵀk[:Dv] / Sᵀk[Dv].
    """
    H, Hkv = state.shape[1], k.shape[2]
    S = state
    if log_alpha is not None:
        la = log_alpha.astype(jnp.float32)
        S = S * jnp.exp(la if la.ndim == 3 else la[..., None])[..., None]
    k32, v32 = expand_kv_heads(k.astype(jnp.float32), H), expand_kv_heads(v.astype(jnp.float32), H)
    recalled = jnp.einsum("bnhk,bhkv->bnhv", k32, S)
    if normalized:
        recalled = recalled[..., :-1] / (recalled[..., -1:] + eps)
    # max, not + eps: against an empty state every token scores exactly 1 (ties keep the older)
    error = jnp.linalg.norm(v32 - recalled, axis=-1) / jnp.maximum(jnp.linalg.norm(v32, axis=-1), eps)
    return error.reshape(error.shape[:2] + (Hkv, H // Hkv)).mean(-1)


def received_mass(scores, mask, row_max, row_sum):
    """The "attention" score's increment: the softmax probability each of K keys received from n queries,
    summed over the queries and averaged over the G query heads of each kv head, [B, K, Hkv] fp32.

    scores [B, Hkv, G, n, K]: scale · q·k as the softmax computed them; mask: which of them the softmax
    read, broadcastable to scores; row_max, row_sum [B, Hkv, G, n]: the statistics of the whole joint
    softmax (sinks, window and retained keys), so a probability is normalised by its own row's sum, not
    by this block's and not with the linear term. Not differentiated: a score only ranks tokens.
    """
    scores, row_max, row_sum = jax.lax.stop_gradient((scores, row_max, row_sum))
    p = jnp.where(mask, jnp.exp(scores - row_max[..., None]), 0.0) / row_sum[..., None]
    return jnp.moveaxis(p.sum(axis=3).mean(axis=2), 1, 2)
