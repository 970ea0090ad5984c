"""The chunked kernels' hand-written backwards: T⁻¹ from its cross blocks (kernels/triangular.py)
and the scalings whose gradients are matrix-vector products (kernels/scaling.py).

Each custom backward is checked against autodiff through the plain form it replaces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import scaling, triangular
from tests.helpers import relative_rms


def random_crosses(seed, C, batch=(2, 3)):
    """Cross blocks of a unit lower-triangular T with entries of the delta rule's size (|β kᵀk| ≤ 1)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), C.bit_length())
    crosses, h = [], 1
    for key in keys:
        if h >= C:
            break
        crosses.append(jax.random.uniform(key, (*batch, C // (2 * h), h, h), minval=-1.0, maxval=1.0) / h)
        h *= 2
    return crosses


def assemble(crosses, C):
    """T itself, [..., C, C], placed block by block from the cross blocks (numpy, independent of the kernel)."""
    batch = crosses[0].shape[:-3]
    matrix = np.tile(np.eye(C, dtype=np.float32), (*batch, 1, 1))
    for cross in crosses:
        n, h = cross.shape[-3], cross.shape[-1]
        for block in range(n):
            rows, cols = slice(2 * h * block + h, 2 * h * block + 2 * h), slice(2 * h * block, 2 * h * block + h)
            matrix[..., rows, cols] = np.asarray(cross[..., block, :, :])
    return matrix


@pytest.mark.parametrize("C", [2, 8, 32])
def test_unit_lower_inverse_inverts(C):
    crosses = random_crosses(0, C)
    matrix = assemble(crosses, C)
    inverse = np.asarray(triangular.unit_lower_inverse(crosses))
    np.testing.assert_allclose(inverse @ matrix, np.broadcast_to(np.eye(C), matrix.shape), atol=2e-5)
    np.testing.assert_array_equal(np.triu(inverse, 1), 0.0)


@pytest.mark.parametrize("C", [2, 8, 32])
def test_unit_lower_inverse_gradient_matches_autodiff(C):
    crosses = random_crosses(1, C)
    weights = jax.random.normal(jax.random.PRNGKey(2), (*crosses[0].shape[:-3], C, C))
    loss = lambda inverse_fn: lambda cs: jnp.sum(jnp.sin(inverse_fn(cs)) * weights)
    closed_form = jax.grad(loss(triangular.unit_lower_inverse))(crosses)
    autodiff = jax.grad(loss(triangular._inverse))(crosses)
    for got, want in zip(closed_form, autodiff, strict=True):
        assert got.shape == want.shape
        assert relative_rms(got, want) < 1e-5


@pytest.mark.parametrize("rows_of_s", [5, 1])
def test_scale_rows_matches_broadcast(rows_of_s):
    key_s, key_x, key_w = jax.random.split(jax.random.PRNGKey(3), 3)
    s = jax.random.uniform(key_s, (2, 3, rows_of_s))
    x = jax.random.normal(key_x, (2, 3, 5, 4))
    w = jax.random.normal(key_w, (2, 3, 5, 4))
    plain = lambda s, x: s[..., None] * x
    for fn in (plain, scaling.scale_rows):
        assert fn(s, x).shape == x.shape
    loss = lambda fn: lambda s, x: jnp.sum(jnp.cos(fn(s, x)) * w)
    np.testing.assert_allclose(scaling.scale_rows(s, x), plain(s, x), rtol=1e-6)
    for got, want in zip(jax.grad(loss(scaling.scale_rows), (0, 1))(s, x), jax.grad(loss(plain), (0, 1))(s, x)):
        assert got.shape == want.shape
        assert relative_rms(got, want) < 1e-6


def test_scale_cols_and_the_sums_match_plain_forms():
    key_s, key_x, key_w = jax.random.split(jax.random.PRNGKey(4), 3)
    x = jax.random.normal(key_x, (2, 3, 5, 4))
    s = jax.random.uniform(key_s, (2, 3, 4))
    w = jax.random.normal(key_w, (2, 3, 5, 4))
    plain = lambda x, s: x * s[..., None, :]
    loss = lambda fn: lambda x, s: jnp.sum(jnp.cos(fn(x, s)) * w)
    np.testing.assert_allclose(scaling.scale_cols(x, s), plain(x, s), rtol=1e-6)
    for got, want in zip(jax.grad(loss(scaling.scale_cols), (0, 1))(x, s), jax.grad(loss(plain), (0, 1))(x, s)):
        assert relative_rms(got, want) < 1e-6
    np.testing.assert_allclose(scaling.row_sums(x), jnp.sum(x, axis=-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scaling.column_sums(x), jnp.sum(x, axis=-2), rtol=1e-5, atol=1e-6)
