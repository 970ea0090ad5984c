"""LLaMA / Qwen decoder in Flax NNX.

What it does differently from the Hugging Face modules it mirrors:
- one class covers Llama 2/3/3.1/3.2, SmolLM2, Qwen2 (q/k/v bias) and Qwen3
  (per-head q/k RMSNorm); the differences are `ModelConfig` fields;
- each block's attention is a *mixer* (`block.attn`), which linearization
  swaps for a linear mechanism while keeping the pretrained projections;
- decoding state is a per-layer list of pytrees (KV caches here), passed in
  and returned explicitly instead of living inside the module;
- runs of identical blocks execute as one `lax.scan` (linjax/scan.py), so a
  30-layer model compiles one block per layer type; `scan_layers` and `remat`
  choose how;
- the residual stream is walked here only: code that needs what a block's
  mixer reads and writes (attention transfer, approximation error, key
  diagnostics) asks `CausalLM.attention_activations` instead of rebuilding
  the block's wiring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linjax.config import ModelConfig
from linjax.layers import MLP, RMSNorm
from linjax.mixers.softmax import SoftmaxAttention
from linjax.scan import REMAT_POLICIES, run_layers

SCAN_MODES = ("forward", "always", "never")


class AttentionActivations(NamedTuple):
    """What one block's attention read from and wrote into the residual stream."""

    input: jax.Array   # the normed hidden state the mixer reads, [B,T,d]
    output: jax.Array  # what was added to the residual stream, [B,T,d]


# (mixer, h, positions) → [B,T,d]: stands in for `mixer(h, positions)` in the residual stream.
AttentionOverride = Callable[[nnx.Module, jax.Array, jax.Array], jax.Array]


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.attn = SoftmaxAttention(config, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(config, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, state=None):
        h = self.input_layernorm(x)
        if state is None:
            return self.feed_forward(x + self.attn(h, positions))
        attn_out, state = self.attn(h, positions, state)
        return self.feed_forward(x + attn_out), state

    def with_activations(self, x, positions, attention: AttentionOverride | None = None):
        """(block output, AttentionActivations) without decoding state; `attention`, if given,
        replaces the mixer's output in the residual stream."""
        h = self.input_layernorm(x)
        y = self.attn(h, positions) if attention is None else attention(self.attn, h, positions)
        return self.feed_forward(x + y), AttentionActivations(h, y)

    def feed_forward(self, x):
        """The block's second half: x + mlp(norm(x))."""
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nnx.Module):
    """Decoder-only language model: tokens [B,T] int32 → logits [B,T,vocab]."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.linearize_config = None  # set by `linjax.linearize`
        # "forward": scan runs of identical blocks in calls without decoding states (training,
        # scoring); "always": in decoding too (each call stacks the weights, which costs more than
        # a small model's one-token step); "never": the plain Python loop, the reference.
        self.scan_layers = "forward"
        self.remat = None  # None, "full" or "dots" (linjax.scan.REMAT_POLICIES), inside the scan
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderBlock(config, dtype=dtype, rngs=rngs)
                                for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False,
                                      dtype=dtype, param_dtype=dtype, rngs=rngs)

    def init_states(self, batch: int, max_length: int) -> list:
        """Empty decoding state for every layer (a KV cache for softmax layers)."""
        return [block.attn.init_state(batch, max_length, self.dtype) for block in self.layers]

    def hidden_states(self, tokens, positions=None, states=None):
        """The final-norm hidden states [B,T,d] (and new states when `states` is given)."""
        x, positions = self._embed(tokens, positions, states)
        if self.scan_layers not in SCAN_MODES or (self.remat is not None and self.remat not in REMAT_POLICIES):
            raise ValueError(f"scan_layers={self.scan_layers!r}, remat={self.remat!r}; choose scan_layers from "
                             f"{SCAN_MODES} and remat from None, {', '.join(map(repr, REMAT_POLICIES))}")
        if self.scan_layers == "always" or (self.scan_layers == "forward" and states is None):
            x, new_states = run_layers(self.layers, x, positions, states, remat=self.remat)
        else:
            new_states = None if states is None else []
            for i, block in enumerate(self.layers):
                if states is None:
                    x = block(x, positions)
                else:
                    x, layer_state = block(x, positions, states[i])
                    new_states.append(layer_state)
        x = self.norm(x)
        return x if states is None else (x, new_states)

    def attention_activations(self, tokens, positions=None,
                              attention: AttentionOverride | None = None) -> list[AttentionActivations]:
        """Each block's attention input and output over tokens [B,T], in layer order.

        `attention(mixer, h, positions)`, if given, is added to the residual stream instead of each
        block's own mixer output (and returned as the output): attention transfer runs a linearized
        model on the original softmax attention this way, so every layer sees the original model's
        input. The blocks run one by one, not scanned: the per-layer outputs and the override are
        Python-level, and the callers (training objective, analyses) are not the hot forward path.
        """
        return self._run_blocks(tokens, positions, attention)[1]

    def hidden_states_under(self, tokens, attention: AttentionOverride, positions=None):
        """The final-norm hidden states [B,T,d] with `attention(mixer, h, positions)` in place of every
        block's mixer: with the frozen softmax attention, the original model's (distillation's teacher)."""
        return self.norm(self._run_blocks(tokens, positions, attention)[0])

    def _run_blocks(self, tokens, positions, attention):
        x, positions = self._embed(tokens, positions)
        activations = []
        for block in self.layers:
            x, block_activations = block.with_activations(x, positions, attention)
            activations.append(block_activations)
        return x, activations

    def _embed(self, tokens, positions=None, states=None):
        """(token embeddings [B,T,d], positions [B,T]); positions continue after `states`' tokens."""
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"expected int tokens [batch, time], got {tokens.dtype} {tokens.shape}")
        if positions is None:
            positions = token_positions(tokens, 0 if states is None else _cache_length(states))
        return self.embed_tokens(tokens), positions

    def logits(self, x):
        return self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)

    def __call__(self, tokens, positions=None, states=None):
        if states is None:
            return self.logits(self.hidden_states(tokens, positions))
        x, new_states = self.hidden_states(tokens, positions, states)
        return self.logits(x), new_states


def token_positions(tokens, offset=0):
    """Positions [B,T] int32 of tokens [B,T] that follow `offset` earlier tokens."""
    b, t = jnp.shape(tokens)
    return jnp.broadcast_to(offset + jnp.arange(t, dtype=jnp.int32), (b, t))


def _cache_length(states):
    """Tokens already consumed: every layer's decode state counts them in `length` (linjax/mixers/states.py)."""
    if not states:
        raise ValueError("no decoding states (the model has no layers?); pass `positions` explicitly")
    return states[0].length


def abstract_model(hf_config, linearize=None, dtype=jnp.float32) -> CausalLM:
    """The model for an HF config (dict, `transformers` config, config.json path or
    `ModelConfig`), linearized with `linearize` (a LinearizeConfig) if given, built
    under `nnx.eval_shape`: shapes only, no memory cost."""
    config = hf_config if isinstance(hf_config, ModelConfig) else ModelConfig.from_hf(hf_config)

    def build():
        model = CausalLM(config, dtype=dtype, rngs=nnx.Rngs(0))
        if linearize is None:
            return model
        from linjax.linearize import linearize as apply_linearize
        return apply_linearize(model, linearize)

    return nnx.eval_shape(build)


def parameter_count(model: nnx.Module) -> int:
    """Number of parameter scalars (works on abstract models too)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
