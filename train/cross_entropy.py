"""Token cross-entropy with its gradient written out: one pass over the [tokens, vocabulary] logits.

`jax.grad` of `log_softmax` followed by `take_along_axis` builds the logits' gradient in three
passes over a [T, V] array (V = 49,152 for SmolLM2: 200 MB at 1,024 fp32 tokens): a zero-filled
buffer, a scatter of the picked entries into it, and its sum with the softmax term. Here the
backward is the closed form ∂/∂z (logsumexp(z) − z_y) = softmax(z) − onehot(y), one elementwise
pass (the one-hot is a comparison with an iota inside it) that XLA fuses with what reads it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """−log softmax(logits)[targets] per position: logits [..., V] (float), targets [...] (int)."""
    return _forward(logits, targets)[0]


def _forward(logits, targets):
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - picked, (logits, targets, log_normalizer)


def _backward(residuals, cotangent):
    logits, targets, log_normalizer = residuals
    vocabulary = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
    probabilities = jnp.exp(logits - log_normalizer[..., None])
    gradient = probabilities - (vocabulary == targets[..., None]).astype(logits.dtype)
    return cotangent[..., None].astype(logits.dtype) * gradient, None


cross_entropy.defvjp(_forward, _backward)
