"""Autoregressive decoding: one prefill, then one `step` per token, with per-layer states.

The states are whatever each layer's mixer keeps (a KV cache for softmax
attention); they are created by `model.init_states` and threaded through
jitted prefill and decode functions, so the model itself stays stateless.

Evaluations decode many prompts of slightly different lengths (S-NIAH prompts
are within 2% of a target). Every distinct prompt length, and every distinct
KV-cache size, would be a new XLA compilation of the whole model; `prefill_chunk`
and `cache_length` make the shapes fixed so one compilation serves them all:
the prompt goes through prefills of exactly `prefill_chunk` tokens, then its
last T mod chunk tokens through prefills of descending powers of two (at most
log2(chunk) calls, each shape compiled once). Splitting a prefill anywhere gives
the same result as one pass (tested for every mixer); the whole pieces come
first so that they start at multiples of the chunk, where a mixer that works
in blocks (retained tokens with `retain_block`) runs its block form.

Each prefill shape is one program with the layers scanned (one block traced and
compiled per run of identical layers; the weights stacked once per `generate`
call), and the one-token step one with the layer loop (no stacking per token).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linjax import heartbeat
from linjax.scan import layer_runs, stack_layers, unstack_layers


@functools.lru_cache(maxsize=8)
def _compiled_forward(graphdef, stacked: bool = False):
    """One jitted (params, tokens, states) → (last logits, states) per model structure, shared by calls,
    so a second `generate` on the same model and shapes does not compile again. The states are
    donated: caches and rings are updated in place instead of copied at every step. `stacked`: the
    params are held stacked by layer run (`linjax.scan.StackedLayers`)."""

    @functools.partial(jax.jit, donate_argnums=(2,))
    def forward(params, chunk, states):
        model = nnx.merge(graphdef, unstack_layers(params) if stacked else params)
        hidden, states = model.hidden_states(chunk, states=states)
        # Only the last position's logits: XLA does not drop the unused rows of the vocabulary
        # projection (SmolLM2-135M: a fifth of a linearized model's prefill FLOPs).
        return model.logits(hidden[:, -1]).astype(jnp.float32), states

    return forward


def generate(model, tokens, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             eos_token_id: int | None = None, on_token: Callable[[np.ndarray], None] | None = None,
             prefill_chunk: int | None = None, cache_length: int | None = None):
    """Continues `tokens` [B,T] by `max_new_tokens`; greedy unless `temperature` > 0.

    Returns int32 [B, T + n] with n ≤ max_new_tokens (decoding stops early once
    every row has produced `eos_token_id`; rows that finished earlier are padded
    with it). `on_token` receives each new column [B] as it is produced.
    `prefill_chunk`: prefill in pieces of this many tokens (see the module docstring);
    `cache_length`: the states' capacity (default T + max_new_tokens; full-attention
    layers allocate it, linear layers ignore it).
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim == 1:
        raise ValueError(f"expected tokens [batch, time], got shape {tokens.shape}; add a batch axis")
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.shape[1] == 0:
        raise ValueError(f"expected non-empty int tokens [batch, time], got {tokens.dtype} {tokens.shape}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be ≥ 1, got {prefill_chunk}")
    tokens = tokens.astype(jnp.int32)
    if max_new_tokens == 0:
        return tokens
    batch, prompt_len = tokens.shape
    needed = prompt_len + max_new_tokens
    if cache_length is not None and cache_length < needed:
        raise ValueError(f"cache_length {cache_length} is too small for {prompt_len} prompt tokens + "
                         f"{max_new_tokens} new ones; pass at least {needed}")
    refuse_what_cannot_fit(model, batch, cache_length or needed, max_new_tokens)
    graphdef, params = nnx.split(model)
    forward = functools.partial(_compiled_forward(graphdef), params)
    prefill = forward
    if getattr(model, "scan_layers", None) == "forward" and prompt_len > 1:
        # Stacked once per call here, not inside each piece's program.
        stacked = stack_layers(params, layer_runs(model.layers))
        prefill = functools.partial(_compiled_forward(_scanning_layers(graphdef, params), stacked=True), stacked)

    def choose(logits, key):
        if temperature > 0:
            return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    key = jax.random.key(seed)
    states = model.init_states(batch, cache_length or needed)
    logits, states = _prefill(prefill, forward, tokens, states, prefill_chunk)
    finished = np.zeros(batch, bool)
    new = []
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token = np.asarray(choose(logits, sub))
        if eos_token_id is not None:
            token = np.where(finished, eos_token_id, token)
            finished |= token == eos_token_id
        new.append(token)
        heartbeat.progress()
        if on_token is not None:
            on_token(token)
        if finished.all() or i + 1 == max_new_tokens:
            break
        logits, states = forward(jnp.asarray(token)[:, None], states)
    return jnp.concatenate([tokens, jnp.asarray(np.stack(new, axis=1), jnp.int32)], axis=1)


def _gigabytes(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def free_memory() -> int | None:
    """Bytes free where the decoding state goes: the device's (an accelerator's own memory), else the
    host's available memory; None if unknown."""
    stats = None
    with contextlib.suppress(Exception):  # not every backend keeps statistics
        stats = jax.local_devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def refuse_what_cannot_fit(model, batch: int, cache_length: int, max_new_tokens: int) -> None:
    """A ValueError, before anything is allocated, when the decoding states for `cache_length` positions
    (a KV cache grows with it; a linear layer's state does not) and the tokens produced need more memory
    than is free. The states' size is exact (`jax.eval_shape` builds them without memory); each new
    token also costs a host array of about 128 bytes per row and its place in the result."""
    states = jax.eval_shape(lambda: model.init_states(batch, cache_length))
    needed = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(states)) + 136 * batch * max_new_tokens
    free = free_memory()
    if free is not None and needed > free:
        raise ValueError(f"generating {max_new_tokens:,} tokens (max_new_tokens; the decoding state for "
                         f"{cache_length:,} positions, batch {batch}) needs about {_gigabytes(needed)}, more than "
                         f"the {_gigabytes(free)} free; ask for fewer new tokens")


def _scanning_layers(graphdef, params):
    """`graphdef` with its layers scanned in calls with states too (`CausalLM.scan_layers` "always"), for
    prefill pieces: a piece then traces and compiles one block per run of identical layers instead of
    each layer (30 for SmolLM2), once per piece shape. One-token decode steps keep the layer loop,
    which does not copy the weights into a stack at every call (linjax/scan.py). Same outputs
    (tests/test_scan.py)."""
    model = nnx.merge(graphdef, params)  # new module objects over the same arrays: nothing is copied
    model.scan_layers = "always"
    return nnx.graphdef(model)


def _prefill(prefill, forward, tokens, states, chunk: int | None):
    """The last position's logits and the states after `tokens`: one call, or fixed-shape pieces
    (`prefill` for pieces of several tokens, `forward`, the decode step's program, for single ones)."""
    call = lambda piece, states: (prefill if piece.shape[1] > 1 else forward)(piece, states)  # noqa: E731
    if chunk is None:
        return call(tokens, states)
    tail = tokens.shape[1] % chunk
    # Whole pieces first, then the remainder as pieces of 2^k tokens (its binary digits): a handful of
    # shapes that every prompt length shares, instead of an odd-length compilation or up to chunk − 1 steps.
    pieces = [chunk] * (tokens.shape[1] // chunk)
    pieces += [1 << bit for bit in reversed(range(tail.bit_length())) if tail >> bit & 1]
    logits, start = None, 0
    for size in pieces:
        logits, states = call(tokens[:, start:start + size], states)
        start += size
        heartbeat.progress()
    return logits, states
