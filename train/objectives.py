"""Training objectives: next-token cross-entropy, and layer-wise attention transfer.

Attention transfer (LoLCATs' first stage; the paper's approximation error is
the same quantity) matches each linearized block's attention output to the
frozen softmax attention output of that block on the same input. The inputs
are the original model's hidden states (the teacher's residual stream), so
each layer learns to approximate its own softmax attention, independently of
how well the layers below it do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linjax.mixers.softmax import SoftmaxAttention, pretrained_attention
from linjax.model import token_positions
from linjax.train.cross_entropy import cross_entropy


def next_token_loss(model, tokens: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (fp32)."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return jnp.mean(cross_entropy(logits, tokens[:, 1:]))


def attention_transfer_loss(model, tokens: jax.Array) -> jax.Array:
    """Mean over linearized layers of the MSE between their attention output and softmax attention's."""
    positions = token_positions(tokens)

    def teacher(mixer, h, positions):  # the frozen softmax attention, carried in the residual stream
        return jax.lax.stop_gradient(pretrained_attention(mixer.proj, h, positions))

    activations = model.attention_activations(tokens, positions, attention=teacher)
    losses = []
    for block, layer in zip(model.layers, activations):
        if not isinstance(block.attn, SoftmaxAttention):
            student = block.attn(layer.input, positions)
            losses.append(jnp.mean(jnp.square(student.astype(jnp.float32) - layer.output.astype(jnp.float32))))
    if not losses:
        raise ValueError("attention transfer needs at least one linearized layer")
    return jnp.mean(jnp.stack(losses))


def objective_loss(model, tokens, objective: str):
    """(loss, metrics) for 'ce', 'attention_transfer' or 'ce+attention_transfer' (a plain sum)."""
    metrics = {}
    loss = 0.0
    parts = objective.split("+")
    if "ce" in parts:
        metrics["ce"] = next_token_loss(model, tokens)
        loss = loss + metrics["ce"]
    if "attention_transfer" in parts:
        metrics["attention_mse"] = attention_transfer_loss(model, tokens)
        loss = loss + metrics["attention_mse"]
    return loss, metrics
