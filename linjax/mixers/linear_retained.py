"""A linear mixer's forward with retained tokens (docs/retention.md): `LinearMixer.__call__` when
`retain` > 0, token by token (`by_tokens`) or a block of `retain_block` tokens at a time
(`by_blocks`). Part of LinearMixer, kept in its own file: functions of a mixer (`mixer`) whose
projections, features, gates and kernel are used as they are; only the order in which tokens
reach the state and the softmax changes. Which tokens are retained, and the slots themselves,
are SinksWindow's (sinks_window.py) and kernels/retention.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linjax.kernels import retention
from linjax.mixers.states import LinearState


def by_tokens(mixer, x, positions, state: LinearState | None, retain_nothing: bool = False):
    """The mixer with retained tokens: every mode (training, prefill, decode) is a `lax.scan` of one
    decode step over the tokens, so a prefill then decode equals decoding the prompt token by token
    by construction. Sequential in T (the retained set depends on the state); projections, short
    conv, features and gates still run over the whole block. `retain_nothing`: the same scan with
    no retained slots (the window's decode step, token by token), for tests."""
    q, k, v = mixer.proj.qkv(x, positions, mixer.lora)
    softmax_qkv, (q, k, v), conv_state = mixer._window_and_linear_qkv(q, k, v, state)
    q, k = mixer.features(q, k)
    linear_inputs = (k, v) + tuple(mixer.gates(x, k))
    stays = mixer._stays(linear_inputs)
    start = mixer.init_state(x.shape[0], 0, x.dtype) if state is None else state
    window = start.window._replace(retained=None) if retain_nothing else start.window

    def one_token(carry, token):
        linear, window = carry
        sq, sk, sv, lq, *lin = (a[:, None] for a in token)

        def recall(keys, values, decay):
            return retention.recall_error(linear, keys, values, decay, normalized=mixer.normalized)

        parts, (lk, lv, *lgates), window = mixer.sinks_window.retaining_step(
            sq, sk, sv, linear_inputs=tuple(lin), cache=window, recall=recall, stays=stays)
        out, linear, normaliser = mixer._run_kernel(lq, lk, lv, lgates, LinearState(linear, None, None, None))
        first = lambda a: a[:, 0]  # the step's own time axis of one
        return (linear, window), jax.tree.map(first, (out, normaliser, parts))

    time_first = lambda a: jnp.moveaxis(a, 1, 0)
    tokens = tuple(map(time_first, softmax_qkv + (q,) + linear_inputs))
    (linear_state, window_state), per_token = jax.lax.scan(one_token, (start.linear, window), tokens)
    lin_out, normaliser, parts = jax.tree.map(time_first, per_token)
    y = mixer._combine(*mixer._apply_gain(lin_out, normaliser), parts)
    out = mixer.proj.out(y.astype(x.dtype), mixer.lora)
    if state is None:
        return out
    if retain_nothing:
        window_state = window_state._replace(retained=start.window.retained)
    return out, LinearState(linear_state, state.length + x.shape[1], conv_state, window_state)


def by_blocks(mixer, x, positions, state: LinearState | None):
    """The mixer with retained tokens chosen a block of `retain_block` C tokens at a time
    (SinksWindow's docstring): a `lax.scan` over blocks of C when the tokens start at a block
    boundary (training and any forward without a cache, of any length; prefill pieces of a multiple
    of C that start at one), else over single tokens (decode, other pieces); both run the same
    `_block_piece`, so any split of a sequence gives the same outputs. Within a block the state does
    not change; at each boundary it takes the tokens that lost (or never won) a slot."""
    C = mixer.sinks_window.retain_block
    q, k, v = mixer.proj.qkv(x, positions, mixer.lora)
    softmax_qkv, (q, k, v), conv_state = mixer._window_and_linear_qkv(q, k, v, state)
    q, k = mixer.features(q, k)
    inputs = softmax_qkv + (q, k, v) + tuple(mixer.gates(x, k))
    start = mixer.init_state(x.shape[0], 0, x.dtype) if state is None else state
    T = x.shape[1]

    def scan_pieces(size):
        """Pieces of `size` tokens, then the fewer than `size` left over as one more piece (with size C:
        whole blocks, then the start of one, so a sequence that starts at a boundary is read by blocks
        whatever its length; a training batch of L tokens predicts from L − 1)."""
        whole = T // size * size
        carry, out = (start.linear, start.window), None
        if whole:
            pieces = tuple(jnp.moveaxis(a[:, :whole].reshape((a.shape[0], whole // size, size) + a.shape[2:]), 1, 0)
                           for a in inputs)
            carry, out = jax.lax.scan(functools.partial(_block_piece, mixer), carry, pieces)
            # [pieces, B, size, ...] -> [B, whole, ...]
            out = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1).reshape((a.shape[1], whole) + a.shape[3:]), out)
        if whole < T:
            carry, rest = _block_piece(mixer, carry, tuple(a[:, whole:] for a in inputs))
            out = rest if out is None else jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), out, rest)
        return carry, out

    if state is None:  # training, or a forward without a cache: the sequence starts at a boundary
        carry, per_token = scan_pieces(C)
    elif T % C:
        carry, per_token = scan_pieces(1)
    else:
        carry, per_token = jax.lax.cond(start.window.length % C == 0, lambda: scan_pieces(C),
                                        lambda: scan_pieces(1))
    (linear_state, window_state), (lin_out, normaliser, parts) = carry, per_token
    y = mixer._combine(*mixer._apply_gain(lin_out, normaliser), parts)
    out = mixer.proj.out(y.astype(x.dtype), mixer.lora)
    if state is None:
        return out
    return out, LinearState(linear_state, state.length + T, conv_state, window_state)


def _block_piece(mixer, carry, piece):
    """n tokens within one block (`by_blocks`): first, at a block boundary, the C tokens
    leaving the window are scored with the retained ones and the losers written into the state; then
    the softmax over sinks ∪ retained ∪ block-aligned window and the state's readout."""
    linear, window = carry
    sq, sk, sv, lq, *lin = piece
    at_boundary = window.length % mixer.sinks_window.retain_block == 0
    linear, window = jax.lax.cond(at_boundary, functools.partial(_block_boundary, mixer),
                                  lambda linear, window: (linear, window), linear, window)
    parts, window = mixer.sinks_window.block_attend(sq, sk, sv, linear_inputs=tuple(lin), cache=window)
    # the readout q·S of a state that does not change within the block: the kernel with nothing to write
    nothing = [jnp.zeros_like(a) for a in lin]
    out, _, normaliser = mixer._run_kernel(lq, nothing[0], nothing[1], nothing[2:],
                                          LinearState(linear, None, None, None))
    return (linear, window), (out, normaliser, parts)


def _block_boundary(mixer, linear, window):
    """The C tokens leaving the window and the R retained ones compete for the R slots (by "recall", scored
    against the state they would enter: the current one after the block's decay); the C others are written into
    the state in position order, one per step with the leaving tokens' decays, so the state decays as
    without retention and only what it stores changes."""
    (leaving_k, leaving_v), leaving, position, valid = mixer.sinks_window.leaving_block(window)
    stays = mixer._stays(leaving)
    decay = leaving[stays[0]] if stays else None
    retained = window.retained
    if mixer.sinks_window.retain_score == "key_norm":
        score = retention.key_norm(leaving_k)
    elif mixer.sinks_window.retain_score == "attention":  # the held tokens keep their scores (leaving_mass)
        score = mixer.sinks_window.leaving_mass(window)
    else:
        total = None if decay is None else decay.sum(axis=1)
        recall = lambda keys, values: retention.recall_error(linear, keys, values, total,
                                                             normalized=mixer.normalized)
        score = recall(leaving[0], leaving[1])
        retained = retained._replace(score=jnp.where(retained.position >= 0,
                                                     recall(retained.entries[2], retained.entries[3]), -jnp.inf))
    travelling = tuple(x for i, x in enumerate(leaving) if i not in stays)
    valid = jnp.broadcast_to(valid[None, :, None], score.shape)
    retained, written, written_valid = retention.select(retained, (leaving_k, leaving_v) + travelling, score,
                                                        jnp.broadcast_to(position, score.shape[:2]), valid)
    entry = iter(written[2:])
    inputs = [x if i in stays else next(entry) for i, x in enumerate(leaving)]
    inputs[0] = jnp.where(written_valid[..., None], inputs[0], jnp.zeros((), inputs[0].dtype))
    no_query = jnp.zeros(inputs[0].shape[:2] + (mixer.proj.num_heads, inputs[0].shape[-1]), inputs[0].dtype)
    _, linear, _ = mixer._run_kernel(no_query, inputs[0], inputs[1], inputs[2:], LinearState(linear, None, None, None))
    return linear, window._replace(retained=retained)
