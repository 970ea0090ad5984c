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
from flax import nnx

from linjax.mixers.softmax import SoftmaxAttention, pretrained_attention
from linjax.model import token_positions
from linjax.scan import layer_runs, stack
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
    # The students run as one scan per run of identical layers, so each linearized mixer and its
    # backward compile once per run, not once per layer (SmolLM2's final recipe, first step at 512
    # tokens: 61 s with a Python loop over the 30 layers).
    for run in layer_runs(model.layers):
        mixers = [model.layers[i].attn for i in run]
        if isinstance(mixers[0], SoftmaxAttention):
            continue
        layer_inputs = jnp.stack([activations[i].input for i in run])
        layer_targets = jnp.stack([activations[i].output for i in run])

        def one_layer(_, xs, graphdef=nnx.graphdef(mixers[0])):
            state, h, target = xs
            student = nnx.merge(graphdef, state)(h, positions)
            return None, jnp.mean(jnp.square(student.astype(jnp.float32) - target.astype(jnp.float32)))

        _, run_losses = jax.lax.scan(one_layer, None, (stack([nnx.state(m) for m in mixers]), layer_inputs,
                                                       layer_targets))
        losses.append(run_losses)
    if not losses:
        raise ValueError("attention transfer needs at least one linearized layer")
    return jnp.mean(jnp.concatenate(losses))


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
