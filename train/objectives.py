"""Training objectives: next-token cross-entropy, layer-wise attention transfer, and distillation.

Attention transfer (LoLCATs' first stage; the paper's approximation error is
the same quantity) matches each linearized block's attention output to the
frozen softmax attention output of that block on the same input. The inputs
are the original model's hidden states (the teacher's residual stream), so
each layer learns to approximate its own softmax attention, independently of
how well the layers below it do.

Distillation matches the linearized model's next-token distribution to the original model's (the same
weights on their frozen softmax attention): every position carries the teacher's whole distribution
instead of one observed token. Nearer the teacher is not lower perplexity: results/claims.md measures a
LoRA stage trained either way (experiments/teacher_kl.py, both quantities on the same tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.mixers.softmax import SoftmaxAttention, pretrained_attention
from linjax.model import token_positions
from linjax.scan import layer_runs, run_layers, stack
from linjax.train.cross_entropy import cross_entropy


def next_token_loss(model, tokens: jax.Array, loss_chunk: int | None = None) -> jax.Array:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1] (fp32); `loss_chunk` as in `lm_loss`.

    The model reads all T tokens and the last position's prediction is dropped: causal, so the loss is
    the same as from T − 1 tokens, while the kernels see T (a multiple of their chunk at the usual
    lengths: no padding copies; an even length, which cuDNN's attention needs to train)."""
    return lm_loss(model, model.hidden_states(tokens)[:, :-1], tokens[:, 1:], loss_chunk)


def lm_loss(model, hidden: jax.Array, targets: jax.Array, chunk: int | None = None) -> jax.Array:
    """Mean cross-entropy of the LM head on final hidden states [B,T,d] against targets [B,T] (fp32).

    With `chunk`, the head and the loss run over `chunk` positions at a time and each piece is
    recomputed in the backward: the [B, T, V] fp32 logits are never held at once, only one
    [B, chunk, V] piece (Llama 3 at 4,096 tokens: 2.1 GB of logits and as much for their gradient).
    """
    def piece_loss(h, t):
        return jnp.sum(cross_entropy(model.logits(h).astype(jnp.float32), t))

    return _mean_over_positions(piece_loss, chunk, hidden, targets)


def _mean_over_positions(piece_sum, chunk: int | None, *arrays: jax.Array) -> jax.Array:
    """sum(piece_sum(pieces)) / (B·T) over `arrays` [B,T,...] cut into `chunk` positions at a time, each
    piece recomputed in the backward (None: one piece)."""
    B, T = arrays[0].shape[:2]
    if chunk is None or chunk >= T:
        return piece_sum(*arrays) / (B * T)
    piece_sum = jax.checkpoint(piece_sum, prevent_cse=False)
    edges = list(range(chunk, T, chunk))
    pieces = zip(*(jnp.split(a, edges, axis=1) for a in arrays))
    return sum(piece_sum(*piece) for piece in pieces) / (B * T)


def distillation_loss(model, tokens: jax.Array, loss_chunk: int | None = None) -> jax.Array:
    """Mean KL(teacher ‖ student) of the next-token distributions at every position (fp32); the teacher
    is the original model (`pretrained_attention` in every block, no adapters), its side without a
    gradient; `loss_chunk` as in `lm_loss`."""
    teacher = jax.lax.stop_gradient(model.hidden_states_under(tokens, original_attention))
    student = model.hidden_states(tokens)

    def piece_kl(s, t):
        log_p = jax.nn.log_softmax(model.logits(t).astype(jnp.float32), axis=-1)
        log_q = jax.nn.log_softmax(model.logits(s).astype(jnp.float32), axis=-1)
        return jnp.sum(jnp.exp(log_p) * (log_p - log_q))

    return _mean_over_positions(piece_kl, loss_chunk, student, teacher)


def original_attention(mixer, h, positions):
    """Attention override: the block's original attention output, without a gradient."""
    return jax.lax.stop_gradient(pretrained_attention(mixer.proj, h, positions))


def embedding_floor_loss(model, embeddings: jax.Array, tokens: jax.Array, loss_chunk: int | None = None):
    """`next_token_loss` from given input embeddings [B,T,d] of `tokens`: its gradient with respect to the
    embeddings, every weight frozen, is the floor any training step of parameters inside the model pays
    (bench/gpu_check.py, the CUDA-lowering guards)."""
    x, _ = run_layers(model.layers, embeddings, token_positions(tokens), remat=model.remat)
    return lm_loss(model, model.norm(x[:, :-1]), tokens[:, 1:], loss_chunk)


def attention_transfer_loss(model, tokens: jax.Array) -> jax.Array:
    """Mean over linearized layers of the MSE between their attention output and softmax attention's."""
    positions = token_positions(tokens)
    # The frozen softmax attention, carried in the residual stream.
    activations = model.attention_activations(tokens, positions, attention=original_attention)
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

        def one_layer(_, xs, graphdef=nnx.graphdef(mixers[0])):  # noqa: B008 (bound once, on purpose)
            state, h, target = xs
            student = nnx.merge(graphdef, state)(h, positions)
            return None, jnp.mean(jnp.square(student.astype(jnp.float32) - target.astype(jnp.float32)))

        _, run_losses = jax.lax.scan(one_layer, None, (stack([nnx.state(m) for m in mixers]), layer_inputs,
                                                       layer_targets))
        losses.append(run_losses)
    if not losses:
        raise ValueError("attention transfer needs at least one linearized layer")
    return jnp.mean(jnp.concatenate(losses))


def objective_loss(model, tokens, objective: str, loss_chunk: int | None = None):
    """(loss, metrics) for an objective of `experiment.OBJECTIVES`: 'ce', 'attention_transfer',
    'distillation', or two joined by '+' (a plain sum); `loss_chunk` as in `lm_loss`."""
    metrics = {}
    loss = 0.0
    parts = objective.split("+")
    if "ce" in parts:
        metrics["ce"] = next_token_loss(model, tokens, loss_chunk)
        loss = loss + metrics["ce"]
    if "distillation" in parts:
        metrics["distillation_kl"] = distillation_loss(model, tokens, loss_chunk)
        loss = loss + metrics["distillation_kl"]
    if "attention_transfer" in parts:
        metrics["attention_mse"] = attention_transfer_loss(model, tokens)
        loss = loss + metrics["attention_mse"]
    return loss, metrics
