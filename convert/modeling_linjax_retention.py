"""Retained tokens in the PyTorch mirror (docs/retention.md): linjax's kernels/retention.py in torch.

With `linearize.retain` = R > 0 a linear mixer keeps R slots per kv head for tokens that left the
window, chosen by score, and its softmax part runs over sinks ∪ window ∪ retained. A token leaving
the window (not a sink) takes a slot if one is empty or if its score is above the lowest held;
among equal lowest scores the newest retained token gives way, so ties keep the older. The token
that loses its slot, or the one refused, is written into the linear state at that step in place
of the leaving token. `LinearAttention.forward_retaining` (modeling_linjax_linear.py) runs this one
token at a time, as linjax's SinksWindow.retaining_step does; the slots live in the layer's cache
(modeling_linjax_cache.py RetainedSlots). The functions, per kv head:

    key_norm(k) -> scores                                    ‖k‖ of the pretrained key
    recall_error(state, k, v, log_decay, normalized) -> scores    LoLA's ‖v − Sᵀk‖ / ‖v‖, now
    received_mass(q, keys, seen, row_max, row_sum) -> mass   one query's softmax probabilities of keys
    admit(slots, candidate, score, position) -> (written, written_valid)
    select(slots, candidates, score, position, valid) -> (written, written_valid)   C at once
    attend(q, slots) -> (numerator, row_max, row_sum)        the retained keys' share of the softmax
    merge(a, b) -> (numerator, row_max, row_sum)             two parts over disjoint keys as one

Arrays per kv head are [B, Hkv, ...], per query head [B, H, ...] (query head h reads kv head
h // (H / Hkv)); slots add a slot axis after the batch: [B, R, heads, ...]. Imports only torch.
"""

from __future__ import annotations

import torch

from .modeling_linjax_kernels import MASKED, expand_kv

SCORES = ("recall", "key_norm", "attention")


def key_norm(k):
    """‖k‖ of the pretrained (post-RoPE) key, k [B, Hkv, D] -> [B, Hkv]: the cheap score, no state needed."""
    k = k.float()
    return torch.sqrt((k * k).sum(-1))


def recall_error(state, k, v, log_decay=None, *, normalized: bool = False, eps: float = 1e-6):
    """LoLA's self-recall error of N tokens against the state they would enter now, per kv head [B, N, Hkv]:

        ‖v − Sᵀk‖ / ‖v‖,   S = Diag(α) S_prev (this step's decay applied first, as the delta rule does)

    averaged over the query heads of each kv head. state [B, H, Dk, Dv] fp32; k [B, N, Hkv, Dk] and
    v [B, N, Hkv, Dv] the linear inputs as the state stores them; log_decay [B, H, Dk], [B, H] or None.
    `normalized` (Hedgehog): v is [v, 1] and the readout is Sᵀk[:-1] / Sᵀk[-1].
    """
    H, Hkv = state.shape[1], k.shape[2]
    S = state
    if log_decay is not None:
        decay = log_decay.float().exp()
        S = S * (decay if decay.dim() == 3 else decay[..., None])[..., None]
    k, v = expand_kv(k.float(), H), expand_kv(v.float(), H)
    recalled = torch.einsum("bnhk,bhkv->bnhv", k, S)
    if normalized:
        v, recalled = v[..., :-1], recalled[..., :-1] / (recalled[..., -1:] + eps)
    # clamp, not + eps: against an empty state every token scores exactly 1 (ties keep the older)
    error = torch.sqrt(((v - recalled) ** 2).sum(-1)) / torch.sqrt((v * v).sum(-1)).clamp_min(eps)
    return error.view(*error.shape[:2], Hkv, H // Hkv).mean(-1)


def received_mass(q, keys, seen, row_max, row_sum):
    """The "attention" score's increment (linjax's retention.received_mass): the probability of each of K
    keys in one query's joint softmax over sinks ∪ window ∪ retained, averaged over the query heads of
    each kv head. q [B, H, D] (scale D^-1/2); keys [B, K, Hkv, D]; seen [K] bool (the keys the query read
    in its window); row_max, row_sum [B, H]: the joint softmax's statistics (`merge`'s). Returns
    [B, K, Hkv] fp32, detached: a score only ranks tokens."""
    B, H, D = q.shape
    Hkv = keys.shape[2]
    G = H // Hkv
    scores = torch.einsum("bkgd,brkd->bkgr", q.detach().float().view(B, Hkv, G, D), keys.detach().float()) * D ** -0.5
    scores = scores.masked_fill(~seen, MASKED)
    p = torch.exp(scores - row_max.detach().view(B, Hkv, G, 1)) / row_sum.detach().view(B, Hkv, G, 1)
    return p.mean(2).transpose(1, 2)


def _per_heads(x, heads: int):
    """[B, Hkv, ...] per kv head as [B, heads, ...] (heads: Hkv, or the H query heads)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _trailing(x, like):
    """x [B, ...] with axes of one appended to broadcast against `like`."""
    return x.view(*x.shape, *([1] * (like.dim() - x.dim())))


def weakest_slot(score, position):
    """[B, Hkv] the slot a newcomer competes with: the lowest score, among equal lowest the newest
    token, among empty slots (score −inf, position −1) the first."""
    lowest = score == score.amin(dim=1, keepdim=True)
    newest = torch.where(lowest, position, torch.full_like(position, -1 << 62)).amax(dim=1, keepdim=True)
    return (lowest & (position == newest)).float().argmax(dim=1)


def _take_slot(slots, index):
    """slots [B, R, heads, ...], index [B, Hkv] -> [B, heads, ...], the slot each head names."""
    index = _per_heads(index, slots.shape[2])[:, None]
    index = _trailing(index, slots).expand(-1, 1, -1, *slots.shape[3:])
    return slots.gather(1, index)[:, 0]


def _put_slot(slots, index, value, where):
    """slots with slot index[b, g] set to value [B, heads, ...] for the kv heads where `where` [B, Hkv]."""
    heads = slots.shape[2]
    slot_axis = torch.arange(slots.shape[1], device=slots.device)[None, :, None]
    hit = (slot_axis == _per_heads(index, heads)[:, None, :]) & _per_heads(where, heads)[:, None, :]
    return torch.where(_trailing(hit, slots), value[:, None].to(slots.dtype), slots)


def admit(slots, candidate: list, score, position: int):
    """Offers one token leaving the window (not a sink) to the slots, in place, per kv head.

    `slots`: a RetainedSlots; candidate: the token's entries [B, heads, ...] in `slots.entries()` order
    (pretrained k, v, then the linear inputs it would be written into the state with); score [B, Hkv];
    position: its position. Admitted where its score is above the weakest slot's. Returns (the linear
    entries written into the state: the evicted token's where one was admitted, else the candidate's;
    written_valid [B, Hkv], False where an empty slot took the candidate and nothing is written).
    """
    score = score.float()
    slot = weakest_slot(slots.score, slots.position)
    held_score = slots.score.gather(1, slot[:, None])[:, 0]
    held_position = slots.position.gather(1, slot[:, None])[:, 0]
    admitted = score > held_score
    entries = slots.entries()
    held = [_take_slot(x, slot) for x in entries]
    written = [torch.where(_trailing(_per_heads(admitted, h.shape[1]), h), h, c.to(h.dtype))
               for h, c in zip(held[2:], candidate[2:])]
    written_valid = ~admitted | (held_position >= 0)
    slots.set_entries([_put_slot(x, slot, c, admitted) for x, c in zip(entries, candidate)])
    slots.score = _put_slot(slots.score, slot, score, admitted)
    slots.position = _put_slot(slots.position, slot, torch.full_like(held_position, position), admitted)
    return written, written_valid


def _gather_slots(x, index):
    """x [B, N, heads, ...], index [B, M, Hkv] (per kv head) -> [B, M, heads, ...]."""
    index = index.repeat_interleave(x.shape[2] // index.shape[2], dim=2)
    return x.gather(1, _trailing(index, x).expand(*index.shape, *x.shape[3:]))


def select(slots, candidates: list, score, position, valid):
    """C tokens leaving the window at once (`linearize.retain_block` = C, linjax's retention.select), in
    place, per kv head: the R held tokens (their scores already renewed) and the C candidates compete;
    the R best stay (higher score first, then the older; non-tokens last) and the C others are returned
    in position order, non-tokens last. candidates: entries [B, C, heads, ...] in `slots.entries()`
    order; score, valid [B, C, Hkv]; position [B, C, Hkv]. Returns (the written linear entries
    [B, C, heads, ...], written_valid [B, C, Hkv])."""
    pool_valid = torch.cat([slots.position >= 0, valid], dim=1)
    pool_score = torch.cat([slots.score, score.float()], dim=1).masked_fill(~pool_valid, -torch.inf)
    pool_position = torch.cat([slots.position, position.long()], dim=1)
    # three stable sorts, least significant key first: position, then score (high first), then tokens first
    order = pool_position.argsort(dim=1, stable=True)
    for key in (-pool_score, (~pool_valid).long()):
        order = order.gather(1, key.gather(1, order).argsort(dim=1, stable=True))
    R = slots.score.shape[1]
    kept, rest = order[:, :R], order[:, R:]
    rest_order = rest.gather(1, pool_position.gather(1, rest).argsort(dim=1, stable=True))
    rest = rest_order.gather(1, (~pool_valid).long().gather(1, rest_order).argsort(dim=1, stable=True))
    pool = [torch.cat([held, c.to(held.dtype)], dim=1) for held, c in zip(slots.entries(), candidates)]
    kept_valid = pool_valid.gather(1, kept)
    slots.set_entries([_gather_slots(x, kept) for x in pool])
    slots.score = pool_score.gather(1, kept).masked_fill(~kept_valid, -torch.inf)
    slots.position = pool_position.gather(1, kept).masked_fill(~kept_valid, -1)
    return [_gather_slots(x, rest) for x in pool[2:]], pool_valid.gather(1, rest)


def attend(q, slots):
    """The retained tokens' softmax parts for one query token q [B, H, D], scale D^-1/2 (empty slots masked):
    (numerator [B, H, Dv], row_max [B, H], row_sum [B, H]) fp32, as modeling_linjax_kernels.window_softmax_parts."""
    B, H, D = q.shape
    Hkv = slots.keys.shape[2]
    qg = q.float().view(B, Hkv, H // Hkv, D)
    scores = torch.einsum("bkgd,brkd->bkgr", qg, slots.keys.float()) * D ** -0.5
    held = (slots.position >= 0).transpose(1, 2)[:, :, None, :]  # [B, Hkv, 1, R]
    masked = scores.masked_fill(~held, MASKED)
    row_max = masked.amax(-1)
    p = torch.exp(masked - row_max[..., None]) * held
    numerator = torch.einsum("bkgr,brke->bkge", p, slots.values.float())
    return numerator.reshape(B, H, -1), row_max.reshape(B, H), p.sum(-1).reshape(B, H)


def merge(a, b):
    """One softmax over the union of two disjoint key sets, from each set's (numerator, row_max, row_sum)."""
    row_max = torch.maximum(a[1], b[1])
    wa, wb = torch.exp(a[1] - row_max), torch.exp(b[1] - row_max)
    return a[0] * wa[..., None] + b[0] * wb[..., None], row_max, a[2] * wa + b[2] * wb
