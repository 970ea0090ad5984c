"""Perplexity on held-out text: the whole file tokenised once, scored in non-overlapping windows.

Each window of `seq_len` tokens is scored on its own (a fresh state or cache), as
lm-eval's rolling perplexity does without overlap; the first token of each
window has no context and is not scored.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from linjax import heartbeat


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    count = len(ids) // seq_len
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    if max_windows is not None:
        count = min(count, max_windows)
    return np.asarray(ids[:count * seq_len], np.int32).reshape(count, seq_len)


def perplexity(model, windows: np.ndarray, batch_size: int = 1, progress: bool = False) -> dict:
    """{'perplexity', 'nll', 'tokens', 'windows'} of `model` over token windows [N, L]."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def window_nll(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1]).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0].sum()

    total, scored = 0.0, 0
    for start in tqdm(range(0, len(windows), batch_size), desc="perplexity", disable=not progress):
        batch = jnp.asarray(windows[start:start + batch_size])
        total += float(window_nll(state, batch))
        scored += batch.shape[0] * (batch.shape[1] - 1)
        heartbeat.progress()
    nll = total / scored
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": scored, "windows": int(len(windows))}
