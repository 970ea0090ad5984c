"""The hand-written cross-entropy gradient (linjax/train/cross_entropy.py) against jax.grad of log_softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.train.cross_entropy import cross_entropy


def reference(logits, targets):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("scale", [1.0, 40.0])  # 40: logits far from 0, where a naive exp overflows
def test_values_and_gradients_equal_log_softmax(scale):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(scale * rng.standard_normal((2, 7, 301)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 301, (2, 7)), jnp.int32)
    weights = jnp.asarray(rng.standard_normal((2, 7)), jnp.float32)  # a cotangent that is not all ones

    def weighted(loss_fn):
        return lambda z: jnp.sum(weights * loss_fn(z, targets))

    np.testing.assert_allclose(cross_entropy(logits, targets), reference(logits, targets), rtol=1e-6, atol=1e-5)
    got, expected = jax.jit(jax.grad(weighted(cross_entropy)))(logits), jax.grad(weighted(reference))(logits)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert np.all(np.isfinite(got))


def test_vmap_and_a_gradient_that_sums_to_zero():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 5, 11)), jnp.float32)
    targets = jnp.asarray([[0, 10, 3, 3, 7]] * 3, jnp.int32)
    batched = jax.vmap(cross_entropy)(logits, targets)
    np.testing.assert_allclose(batched, reference(logits, targets), rtol=1e-6)
    _, pullback = jax.vjp(lambda z: cross_entropy(z, targets), logits)
    (gradient,) = pullback(jnp.ones((3, 5), jnp.float32))
    np.testing.assert_allclose(jnp.sum(gradient, axis=-1), 0.0, atol=1e-6)  # softmax − one-hot sums to 0
