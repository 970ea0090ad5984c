"""The full-attention path: blocked causal attention equals the dense reference, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels.softmax_blocked import blocked_causal_attention
from linjax.mixers.softmax import causal_attention
from tests.helpers import relative_rms


@pytest.mark.parametrize("T,block,heads,kv_heads", [(1, 4, 4, 4), (37, 8, 6, 2), (16, 4, 3, 1), (50, 128, 6, 2)])
def test_blocked_causal_attention_equals_dense(T, block, heads, kv_heads):
    keys = jax.random.split(jax.random.PRNGKey(T * 10 + heads), 4)
    q = jax.random.normal(keys[0], (2, T, heads, 16))
    k = jax.random.normal(keys[1], (2, T, kv_heads, 16)) * 2  # peaked softmax rows too
    v = jax.random.normal(keys[2], (2, T, kv_heads, 16))
    w = jax.random.normal(keys[3], (2, T, heads, 16))
    dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    blocked = lambda q, k, v: blocked_causal_attention(q, k, v, block)  # noqa: E731
    for f in (dense, blocked):
        assert f(q, k, v).shape == q.shape
    assert relative_rms(blocked(q, k, v), dense(q, k, v)) < 1e-6
    grads = [jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v) for f in (dense, blocked)]
    for ours, reference in zip(grads[1], grads[0]):
        assert relative_rms(ours, reference) < 1e-6


def test_causal_attention_is_blocked_on_cpu_and_keeps_the_dtype():
    q = jnp.ones((1, 300, 2, 8), jnp.bfloat16)
    out = causal_attention(q, q, q)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    # Probabilities meet the values in their dtype, as in jax.nn.dot_product_attention: the same bf16 rounding.
    dense = jax.nn.dot_product_attention(q, q, q, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(dense, np.float32), rtol=1e-2)
    if jax.default_backend() == "cpu":  # the blocked path: one product pair per query block
        text = jax.jit(causal_attention).lower(q, q, q).as_text()
        assert text.count("dot_general") == 2 * 5  # 300 rows in blocks of 64


def test_the_backward_keeps_no_score_matrix():
    """causal_attention recomputes its blocks in the backward pass: what it saves grows as T, not T²."""
    T, H, D = 512, 4, 16
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, T, H, D)), jnp.float32)

    def saved_sizes(attention):  # the arrays a pullback holds on to
        _, pullback = jax.vjp(attention, q, q, q)
        return [leaf.size for leaf in jax.tree.leaves(pullback)]

    assert max(saved_sizes(causal_attention)) <= T * H * D
    if jax.default_backend() == "cpu":  # without the recomputation, blocks of 64 keep ≈ H·T²/2 scores
        assert sum(saved_sizes(lambda q, k, v: blocked_causal_attention(q, k, v, 64))) > H * T * T / 2
