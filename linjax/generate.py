"""Autoregressive decoding: one prefill, then one `step` per token, with per-layer states.

The states are whatever each layer's mixer keeps (a KV cache for softmax
attention); they are created by `model.init_states` and threaded through
jitted prefill and decode functions, so the model itself stays stateless.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(model, tokens, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             eos_token_id: int | None = None, on_token: Callable[[np.ndarray], None] | None = None):
    """Continues `tokens` [B,T] by `max_new_tokens`; greedy unless `temperature` > 0.

    Returns int32 [B, T + n] with n ≤ max_new_tokens (decoding stops early once
    every row has produced `eos_token_id`; rows that finished earlier are padded
    with it). `on_token` receives each new column [B] as it is produced.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim == 1:
        raise ValueError(f"expected tokens [batch, time], got shape {tokens.shape}; add a batch axis")
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.shape[1] == 0:
        raise ValueError(f"expected non-empty int tokens [batch, time], got {tokens.dtype} {tokens.shape}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    tokens = tokens.astype(jnp.int32)
    if max_new_tokens == 0:
        return tokens
    batch, prompt_len = tokens.shape
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, chunk, states):
        logits, states = nnx.merge(graphdef, params)(chunk, states=states)
        return logits[:, -1].astype(jnp.float32), states

    def choose(logits, key):
        if temperature > 0:
            return jax.random.categorical(key, logits / temperature).astype(jnp.int32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    key = jax.random.key(seed)
    states = model.init_states(batch, prompt_len + max_new_tokens)
    logits, states = forward(params, tokens, states)
    finished = np.zeros(batch, bool)
    new = []
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token = np.asarray(choose(logits, sub))
        if eos_token_id is not None:
            token = np.where(finished, eos_token_id, token)
            finished |= token == eos_token_id
        new.append(token)
        if on_token is not None:
            on_token(token)
        if finished.all() or i + 1 == max_new_tokens:
            break
        logits, states = forward(params, jnp.asarray(token)[:, None], states)
    return jnp.concatenate([tokens, jnp.asarray(np.stack(new, axis=1), jnp.int32)], axis=1)
