"""Sinks + sliding window: the exact softmax part of a mixer and the shift of its linear inputs.

With s sink tokens and a window of w (paper, sec. 4, "Adding Sliding Window Attention"):

    y_t = q_t S_{s:t-w} + softmax-attention(q_t; positions in I_t),
    I_t = { j ≤ t : j < s  or  t − j < w }

`SinksWindow` owns everything on the right of the `+` and the index shift on the left:
the settings (s, w), the softmax over I_t with the pretrained q, k, v, and the inputs of the
linear kernel moved w positions later (sinks removed), so that the kernel's state at t is
S_{s:t-w} and every past token reaches y_t exactly once. The arithmetic is in kernels/swa.py;
this module picks the form for each of the three modes and keeps the decode cache:

    training  no cache         swa.chunked (or swa.pallas) over the whole sequence
    prefill   cache, T > 1     swa.prefill after the cached tokens; the linear inputs' history
                               comes from the rings
    decode    cache, T = 1     swa.step against the ring buffer; the linear kernel gets the
                               one token leaving the window (swa.leaving_window)

With w = 0 (pure linear attention) it passes the linear inputs through and adds nothing.

With `retain` = R > 0 (docs/retention.md, kernels/retention.py) R more tokens per kv head are kept for
their content: I_t = sinks ∪ window ∪ R_t, and the linear kernel gets, at each step, the token
that lost (or never won) a retained slot in place of the token leaving the window. Which tokens
are retained depends on the state, so all three modes run `retaining_step` token by token (the
mixer scans it over a prompt; sequential, exact).

With `retain_block` = C > 1 tokens leave in blocks of C instead (`leaving_block`, `block_attend`):
the window is block-aligned, so every query of block j (positions jC .. jC + C − 1) sees the
positions from (j + 1)·C − w on, between w − C + 1 and w of them, and at each block boundary the C
tokens that fall out compete with the retained ones at once (retention.select). The cache holds at
most s + w + R tokens, as with token-by-token selection, and the mixer scans blocks instead of tokens.

With `retain_score` "attention" the cache also keeps, per window slot and kv head, the softmax mass
its token has received so far (`SinksWindowCache.mass`): every query adds its probabilities over the
window (in the joint softmax with the sinks and the retained tokens), and `leaving_mass` reads a
token's total when it leaves.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.kernels import retention, swa
from linjax.kernels.swa import SoftmaxParts, WindowCache


class SinksWindowCache(NamedTuple):
    """What `SinksWindow` keeps between calls. Its size depends on s and w only, not on the context.

    `retained`: the tokens kept for their content (`retain` > 0; kernels/retention.py), else None.
    """

    softmax: WindowCache  # the pretrained keys/values of the sinks (slots) and the window (a ring)
    linear_inputs: tuple | None = None  # rings [B, w, ...] of the linear inputs (k', v', *gates) still
    #                                     in the window; None when there is no linear term
    retained: retention.RetainedCache | None = None
    mass: jax.Array | None = None  # retain_score "attention": a ring [B, w, Hkv] fp32, the softmax mass the
    #                                token in each window slot has received so far (averaged over query heads)

    @property
    def length(self) -> jax.Array:
        """Tokens seen so far (every decode state counts them; linjax/mixers/states.py)."""
        return self.softmax.length


class SinksWindow(nnx.Module):
    """The sinks + window part of a mixer: settings, three-mode dispatch and decode cache. No parameters."""

    def __init__(self, *, sinks: int, window: int, chunk: int | None = None, use_pallas: bool = False,
                 retain: int = 0, retain_score: str = "recall", retain_block: int = 1):
        if sinks < 0 or window < 0:
            raise ValueError(f"window and sinks must be ≥ 0, got window={window}, sinks={sinks}")
        if sinks and not window:
            raise ValueError(f"sinks={sinks} need a window ≥ 1 (the current token is always attended exactly)")
        if retain < 0 or (retain and not window):
            raise ValueError(f"retain={retain} must be ≥ 0, and > 0 needs a window ≥ 1 (tokens are scored as they "
                             f"leave it); got window={window}")
        if retain_score not in retention.SCORES:
            raise ValueError(f"unknown retain_score {retain_score!r}; choose one of {list(retention.SCORES)}")
        if retain_block < 1 or (retain_block > 1 and not (retain and retain_block <= window)):
            raise ValueError(f"retain_block={retain_block} must be ≥ 1, and > 1 needs retain > 0 and a window of at "
                             f"least that many tokens (got retain={retain}, window={window})")
        self.sinks, self.window = sinks, window
        self.retain, self.retain_score, self.retain_block = retain, retain_score, retain_block
        self.chunk = chunk  # the softmax kernel's query block; None: swa.CHUNK
        self.use_pallas = use_pallas

    @classmethod
    def from_settings(cls, settings) -> SinksWindow:
        """From a LinearizeConfig."""
        return cls(sinks=settings.sinks, window=settings.window, chunk=settings.chunk,
                   use_pallas=settings.uses_pallas(), retain=settings.retain, retain_score=settings.retain_score,
                   retain_block=settings.retain_block)

    def with_budget(self, *, sinks: int, window: int, retain: int | None = None,
                    retain_score: str | None = None, retain_block: int | None = None) -> SinksWindow:
        """A new SinksWindow with another cache budget (retained slots, their score and block unchanged
        unless given) and the same kernels."""
        return SinksWindow(sinks=sinks, window=window, chunk=self.chunk, use_pallas=self.use_pallas,
                           retain=self.retain if retain is None else retain,
                           retain_score=self.retain_score if retain_score is None else retain_score,
                           retain_block=self.retain_block if retain_block is None else retain_block)

    def empty_cache(self, batch: int, kv_heads: int, head_dim: int, dtype=jnp.float32,
                    linear_inputs: tuple | None = None, stays: tuple = ()) -> SinksWindowCache | None:
        """The cache before the first token; None without a window. `linear_inputs`: the shapes of one
        token of each linear input (k', v', *gates, [B, 1, ...]), one ring each; None: no linear term.
        `stays`: with `retain`, the indices of the linear inputs that belong to the step, not the token
        (the decay), which retained slots do not keep (see `retaining_step`)."""
        if not self.window:
            return None
        softmax = swa.empty_cache(batch, kv_heads, head_dim, head_dim, sinks=self.sinks, window=self.window,
                                  dtype=dtype)
        rings = None if linear_inputs is None else tuple(
            jnp.zeros((batch, self.window) + s.shape[2:], s.dtype) for s in linear_inputs)
        retained = None
        if self.retain:
            if linear_inputs is None:
                raise ValueError("retained tokens are written into a linear state when they lose their slot; "
                                 "retain > 0 needs a linear mechanism")
            one = jax.ShapeDtypeStruct((batch, kv_heads, head_dim), dtype)
            travelling = [jax.ShapeDtypeStruct((batch,) + s.shape[2:], s.dtype)
                          for i, s in enumerate(linear_inputs) if i not in stays]
            retained = retention.empty(batch, self.retain, kv_heads, (one, one, *travelling))
        mass = None
        if self.retain and self.retain_score == "attention":
            mass = jnp.zeros((batch, self.window, kv_heads), jnp.float32)
        return SinksWindowCache(softmax, rings, retained, mass)

    def __call__(self, q, k, v, *, linear_inputs: tuple = (), cache: SinksWindowCache | None = None):
        """(softmax parts or None, shifted linear inputs, cache after these tokens or None).

        q, k, v [B, T, H(kv), D]: the pretrained projections after RoPE, for the softmax over I_t.
        linear_inputs: (k', v', *gates) [B, T, ...] of the linear kernel, returned shifted so that the
        kernel's state at t is S_{s:t-w}. cache: None in training, else the cache before these tokens.
        """
        if not self.window:
            return None, linear_inputs, cache
        shifted, rings = self._shift(linear_inputs, cache)
        parts, softmax = self._attend(q, k, v, cache)
        return parts, shifted, None if cache is None else SinksWindowCache(softmax, rings)

    def _shift(self, inputs: tuple, cache: SinksWindowCache | None):
        """The linear inputs moved w positions later (sink keys zeroed), and the rings after them."""
        if not inputs:
            return inputs, None if cache is None else cache.linear_inputs
        if cache is None:
            return swa.shifted_linear_inputs(*inputs, sinks=self.sinks, window=self.window), None
        start = cache.length
        if inputs[0].shape[1] == 1:  # decode: only the token leaving the window enters the state
            shifted = swa.leaving_window(cache.linear_inputs, start, sinks=self.sinks)
        else:
            history = tuple(swa.unroll_ring(ring, start) for ring in cache.linear_inputs)
            shifted = swa.shifted_linear_inputs(*inputs, sinks=self.sinks, window=self.window,
                                                history=history, start=start)
        rings = tuple(swa.write_ring(ring, x, start) for ring, x in zip(cache.linear_inputs, inputs))
        return shifted, rings

    def _attend(self, q, k, v, cache: SinksWindowCache | None) -> tuple[SoftmaxParts, WindowCache | None]:
        """Softmax over the sinks and the window, in the form the mode needs."""
        chunk = {} if self.chunk is None else {"chunk": self.chunk}
        if cache is None:  # training: the backend chosen for the block runs both parts
            run = swa.pallas if self.use_pallas else swa.chunked
            return run(q, k, v, sinks=self.sinks, window=self.window, **chunk), None
        if q.shape[1] == 1:
            parts, softmax = swa.step(q[:, 0], k[:, 0], v[:, 0], cache.softmax)
            return jax.tree.map(lambda a: a[:, None], parts), softmax
        return swa.prefill(q, k, v, cache.softmax, **chunk)

    def retaining_step(self, q, k, v, *, linear_inputs: tuple, cache: SinksWindowCache, recall, stays: tuple = ()):
        """One token with retained slots (or, with retain = 0, the decode step in the same form).

        q, k, v [B, 1, H(kv), D]: the pretrained projections after RoPE; linear_inputs (k', v', *gates)
        [B, 1, ...] of this token. The token at position t − w leaves the window now. If it is not a sink
        it is scored and offered a slot (retention.admit). `retain_score` "key_norm" needs no state;
        "attention" reads the mass the token received in the window (`leaving_mass`), and this query's
        probabilities over the window are added to the ring of masses; "recall" calls
        `recall(k', v', decay)` ([B, N, ...] → [B, N, Hkv]: the mixer's state asked how badly it would
        recall N tokens written into it at this step) for the leaving token and again for every
        retained one, whose scores are replaced: a token kept when the state was empty (all score 1
        then) must give way once the state recalls it better than a newcomer.
        Returns (softmax parts over sinks ∪ window ∪ retained [B, 1, H, ...], linear inputs for the
        kernel's step, cache after the token). The kernel's inputs are those of the token written into
        the state (the evicted or the refused one; key zeroed when there is none), except those at
        `stays` (the decay), which are the leaving token's: the state decays by the same gates, in the
        same order, as without retention, and only what it stores changes.
        """
        t = cache.length
        leaving = swa.leaving_window(cache.linear_inputs, t, sinks=self.sinks)  # key zeroed for a sink
        rings = tuple(swa.write_ring(ring, x, t) for ring, x in zip(cache.linear_inputs, linear_inputs))
        parts, softmax = swa.step(q[:, 0], k[:, 0], v[:, 0], cache.softmax)
        written, retained, mass = leaving, cache.retained, cache.mass
        if retained is not None:
            slot = lambda ring: jax.lax.dynamic_slice_in_dim(ring, t % self.window, 1, axis=1)[:, 0]
            softmax_entry = (slot(cache.softmax.ring_k), slot(cache.softmax.ring_v))
            if self.retain_score == "key_norm":
                score = retention.key_norm(softmax_entry[0])
            elif self.retain_score == "attention":
                score = self.leaving_mass(cache)[:, 0]
            else:
                decay = leaving[stays[0]][:, 0] if stays else None
                score = recall(leaving[0], leaving[1], decay)[:, 0]
                held = recall(retained.entries[2], retained.entries[3], decay)
                retained = retained._replace(score=jnp.where(retained.position >= 0, held, -jnp.inf))
            travelling = [x[:, 0] for i, x in enumerate(leaving) if i not in stays]
            retained, entry, entry_valid = retention.admit(retained, softmax_entry + tuple(travelling), score,
                                                           t - self.window, t - self.window >= self.sinks)
            entry = iter(entry[2:])
            written = [x if i in stays else next(entry)[:, None] for i, x in enumerate(leaving)]
            written[0] = jnp.where(entry_valid[:, None, :, None], written[0], jnp.zeros((), written[0].dtype))
            parts = retention.merge(parts, retention.attend(q[:, 0], retained.entries[0], retained.entries[1],
                                                            retained.position))
            if mass is not None:
                mass = self._mass_after_step(q[:, 0], softmax, parts, mass, t)
        parts = jax.tree.map(lambda a: a[:, None], parts)
        return parts, tuple(written), SinksWindowCache(softmax, rings, retained, mass)

    def _mass_after_step(self, q, softmax: WindowCache, parts: SoftmaxParts, mass, t):
        """The ring of masses after query t (q [B, H, Dk]; `softmax` the window cache with token t in it;
        `parts` the joint softmax over sinks ∪ window ∪ retained): slot t mod w, which held the token
        that has just left (already scored), starts again at 0 for token t, then every window token
        gets its probability in this query's softmax (token t its own)."""
        B, H, Dk = q.shape
        Hkv, W = softmax.ring_k.shape[2], self.window
        ring_position = t - (t - jnp.arange(W)) % W  # as swa.step: t − w + 1 .. t, negative before the start
        qg = q.astype(jnp.float32).reshape(B, Hkv, H // Hkv, Dk)
        scores = Dk ** -0.5 * jnp.einsum("bkgd,brkd->bkgr", qg, softmax.ring_k.astype(jnp.float32))
        per_query = lambda x: x.reshape(B, Hkv, H // Hkv, 1)  # [B, H] -> [B, Hkv, G, n = 1]
        received = retention.received_mass(scores[:, :, :, None], ring_position >= self.sinks,
                                           per_query(parts.row_max), per_query(parts.row_sum))
        return jnp.where((jnp.arange(W) == t % W)[None, :, None], 0.0, mass) + received

    def leaving_mass(self, cache: SinksWindowCache):
        """The "attention" scores [B, C, Hkv] of the C = `retain_block` tokens leaving the window now
        (positions L − w .. L − w + C − 1, L = cache.length a multiple of C): the mass each received
        while in the window, scaled to w queries. Token by token (C = 1) every token is seen by the w
        queries p .. p + w − 1 before it leaves, so this is the plain sum. In blocks the window is
        block-aligned: the i-th leaving token (position p = L − w + i) was seen by the queries p .. L − 1,
        w − i of them, so it is scaled by w / (w − i) (w times its mean probability per query): the first
        tokens of a block are not favoured for having been seen by up to C − 1 more queries.

        The score is then fixed in its slot (no more mass added, no re-scoring): a retained token still
        draws attention through the retained softmax, but adding it would let a held token's total grow
        without bound while a newcomer brings the mass of w queries only, so the first tokens admitted
        would keep their slots for good. Fixed, every score counts w queries and newcomers compete with
        the held tokens on equal footing."""
        C, W = self.retain_block, self.window
        position = cache.length - W + jnp.arange(C)
        return jnp.take(cache.mass, position % W, axis=1) * (W / (W - jnp.arange(C)))[None, :, None]

    def leaving_block(self, cache: SinksWindowCache):
        """At a block boundary (cache.length L a multiple of `retain_block` C): the C tokens that leave the
        block-aligned window now, positions L − w .. L − w + C − 1, read from the rings. Returns (their
        softmax k, v [B, C, Hkv, D]; their linear inputs (k', v', *gates) [B, C, ...]; positions [C];
        valid [C]: a token that is not a sink). Before the sequence starts the rings hold zeros."""
        position = cache.length - self.window + jnp.arange(self.retain_block)
        take = lambda ring: jnp.take(ring, position % self.window, axis=1)
        softmax = (take(cache.softmax.ring_k), take(cache.softmax.ring_v))
        return softmax, tuple(map(take, cache.linear_inputs)), position, position >= max(self.sinks, 0)

    def block_attend(self, q, k, v, *, linear_inputs: tuple, cache: SinksWindowCache):
        """n ≤ C new tokens (positions L .. L + n − 1, all in one block of `retain_block` C) after `cache`:
        the softmax over sinks ∪ retained ∪ the block-aligned window, and the cache after them (rings,
        sinks and length; the retained slots change only at a boundary, in the mixer). q, k, v
        [B, n, H(kv), D]: the pretrained projections after RoPE; linear_inputs [B, n, ...] go into the rings.
        Returns (SoftmaxParts [B, n, H, ...], cache after)."""
        B, n, H, Dk = q.shape
        Hkv, L, W = k.shape[2], cache.length, self.window
        scale = Dk ** -0.5
        f32 = lambda x: x.astype(jnp.float32)
        qg = f32(q).reshape(B, n, Hkv, H // Hkv, Dk)
        t = L + jnp.arange(n)  # the queries' positions
        first = (L // self.retain_block + 1) * self.retain_block - W  # the window's first position in this block
        ring_position = L - W + (jnp.arange(W) - (L - W)) % W  # slot r holds the position ≡ r (mod W) in [L − W, L)
        ring_seen = (ring_position >= first) & (ring_position >= self.sinks) & (ring_position >= 0)
        softmax = swa.update_cache(cache.softmax, k, v)  # the sink slots now hold any sinks among these tokens
        einsum = lambda spec, a, b: jnp.einsum(spec, a, f32(b))
        blocks = [
            (scale * einsum("bnkgd,bskd->bkgns", qg, softmax.sink_k),
             jnp.arange(self.sinks)[None, :] <= t[:, None],
             lambda p: einsum("bkgns,bske->bkgne", p, softmax.sink_v)),
            (scale * einsum("bnkgd,brkd->bkgnr", qg, cache.softmax.ring_k),
             jnp.broadcast_to(ring_seen, (n, W)),
             lambda p: einsum("bkgnr,brke->bkgne", p, cache.softmax.ring_v)),
            (scale * einsum("bnkgd,bmkd->bkgnm", qg, k),
             (t[None, :] <= t[:, None]) & (t[None, :] >= self.sinks),
             lambda p: einsum("bkgnm,bmke->bkgne", p, v)),
        ]
        retained = cache.retained
        held = jnp.moveaxis(retained.position >= 0, 1, 2)[:, :, None, None, :]  # [B, Hkv, 1, 1, R]
        blocks.append((scale * einsum("bnkgd,brkd->bkgnr", qg, retained.entries[0]), held,
                       lambda p: einsum("bkgnr,brke->bkgne", p, retained.entries[1])))
        numerator, row_max, row_sum = swa.softmax_blocks(blocks)
        mass = cache.mass
        if mass is not None:  # "attention": the probabilities of the ring's and the new tokens' keys, in their slots
            (ring_scores, ring_mask, _), (new_scores, new_mask, _) = blocks[1], blocks[2]
            ring = retention.received_mass(ring_scores, ring_mask, row_max, row_sum)
            # The new tokens' slots held tokens that have left (scored at the last boundary) and that none of
            # these queries saw (ring_seen), so the new tokens' masses replace theirs.
            mass = swa.write_ring(mass + ring, retention.received_mass(new_scores, new_mask, row_max, row_sum), L)
        to_tokens = lambda x: jnp.moveaxis(x.reshape((B, H, n) + x.shape[4:]), 1, 2)  # [B,Hkv,G,n,..] -> [B,n,H,..]
        parts = SoftmaxParts(to_tokens(numerator), to_tokens(row_max), to_tokens(row_sum))
        rings = tuple(swa.write_ring(ring, x, L) for ring, x in zip(cache.linear_inputs, linear_inputs))
        return parts, SinksWindowCache(softmax, rings, retained, mass)
