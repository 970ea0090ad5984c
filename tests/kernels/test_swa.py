"""Sink + sliding-window softmax: blocked vs dense, ring-buffer decode and split prefill vs dense, and the
shifted linear term: disjoint coverage of every past position and the gated formula q_t S_{s:t−w}."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import gla, kgla, swa
from tests.helpers import relative_rms
from tests.kernels.test_gla import FAST_COMPILE

B, H = 2, 4
# (T, sinks, window, chunk, Hkv): the paper's 8 + 56, SWA 64 without sinks, windows longer than T,
# more sinks than tokens, chunks smaller than the window and not dividing T, T = 1.
CASES = [(200, 8, 56, 64, 2), (1, 8, 56, 64, 4), (130, 0, 64, 16, 1), (100, 3, 5, 16, 4), (40, 50, 10, 8, 2)]


def _inputs(seed, T, Hkv, D=16, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = 2.0 * rng.standard_normal((B, T, H, D))  # peaky scores: the row max matters
    k, v = rng.standard_normal((B, T, Hkv, D)), rng.standard_normal((B, T, Hkv, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@functools.partial(jax.jit, static_argnames=("sinks", "window", "chunk"), compiler_options=FAST_COMPILE)
def _blocked_and_dense(q, k, v, directions, sinks, window, chunk):
    """(parts, grads) for the blocked and the dense form; loss = random projection of all three parts."""
    def loss(fn, q, k, v):
        parts = fn(q, k, v, sinks=sinks, window=window)
        return sum((x * p).sum() for x, p in zip(parts, directions)), parts

    results = []
    for fn in (functools.partial(swa.chunked, chunk=chunk), swa.reference):
        grads, parts = jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2), has_aux=True)(q, k, v)
        results.append((parts, grads))
    return results


@pytest.mark.parametrize("T, sinks, window, chunk, Hkv", CASES)
def test_blocked_equals_dense(T, sinks, window, chunk, Hkv):
    q, k, v = _inputs(T + window, T, Hkv)
    rng = np.random.default_rng(1)
    directions = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
                       ((B, T, H, 16), (B, T, H), (B, T, H)))
    (parts, grads), (ref, ref_grads) = _blocked_and_dense(q, k, v, directions, sinks, window, chunk)
    assert relative_rms(parts.normalized(), ref.normalized()) <= 1e-5
    assert relative_rms(parts.row_max, ref.row_max) <= 1e-5
    assert relative_rms(parts.row_sum, ref.row_sum) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert relative_rms(g, r) <= 1e-4


def test_dense_reference_is_softmax_over_the_set():
    """The spec itself, against a per-row numpy softmax over I_t = {j ≤ t: j < s or t − j < w}."""
    T, sinks, window = 30, 3, 6
    q, k, v = (np.asarray(x, np.float64) for x in _inputs(2, T, 2))
    o = swa.reference(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), sinks=sinks, window=window).normalized()
    expected = np.zeros((B, T, H, 16))
    for t in range(T):
        attended = [j for j in range(t + 1) if j < sinks or t - j < window]
        for h in range(H):
            s = np.einsum("bd,bjd->bj", q[:, t, h], k[:, attended, h // 2]) / 4.0
            p = np.exp(s - s.max(axis=1, keepdims=True))
            expected[:, t, h] = np.einsum("bj,bjd->bd", p / p.sum(axis=1, keepdims=True), v[:, attended, h // 2])
    assert relative_rms(o, expected) <= 1e-5


@functools.partial(jax.jit, static_argnames=("sinks", "window"), compiler_options=FAST_COMPILE)
def _decode(q, k, v, sinks, window):
    cache = swa.empty_cache(B, k.shape[2], k.shape[3], v.shape[3], sinks=sinks, window=window, dtype=k.dtype)

    def one_token(cache, x):
        parts, cache = swa.step(*x, cache)
        return cache, parts.normalized()

    cache, o = jax.lax.scan(one_token, cache, tuple(jnp.swapaxes(x, 0, 1) for x in (q, k, v)))
    return jnp.swapaxes(o, 0, 1), cache


@pytest.mark.parametrize("T, sinks, window, chunk, Hkv", CASES[:4])
def test_ring_buffer_decode_equals_dense(T, sinks, window, chunk, Hkv):
    q, k, v = _inputs(3 * T, T, Hkv)
    o, cache = _decode(q, k, v, sinks, window)
    assert relative_rms(o, swa.reference(q, k, v, sinks=sinks, window=window).normalized()) <= 1e-5
    assert int(cache.length) == T


@pytest.mark.parametrize("splits", [(1, 64, 65, 130)])
def test_split_prefill_then_decode_equals_dense(splits):
    """Prefill blocks that continue a cache (split anywhere), then two decode steps: all equal one dense pass."""
    T, sinks, window, Hkv = 202, 8, 56, 2
    q, k, v = _inputs(sum(splits), T, Hkv)
    ref = swa.reference(q, k, v, sinks=sinks, window=window).normalized()
    prefill = jax.jit(functools.partial(swa.prefill, chunk=32), compiler_options=FAST_COMPILE)
    cache = swa.empty_cache(B, Hkv, 16, 16, sinks=sinks, window=window)
    outputs = []
    for start, stop in zip((0,) + splits, splits + (T - 2,)):
        parts, cache = prefill(q[:, start:stop], k[:, start:stop], v[:, start:stop], cache)
        outputs.append(parts.normalized())
    for t in (T - 2, T - 1):
        parts, cache = swa.step(q[:, t], k[:, t], v[:, t], cache)
        outputs.append(parts.normalized()[:, None])
    assert relative_rms(jnp.concatenate(outputs, axis=1), ref) <= 1e-5


def test_bf16_inputs():
    q, k, v = _inputs(5, 150, 2, dtype=jnp.bfloat16)
    parts = jax.jit(functools.partial(swa.chunked, sinks=8, window=56), compiler_options=FAST_COMPILE)(q, k, v)
    ref = swa.reference(*(x.astype(jnp.float32) for x in (q, k, v)), sinks=8, window=56)
    assert parts.numerator.dtype == jnp.float32
    assert relative_rms(parts.normalized(), ref.normalized()) <= 5e-3


# --------------------------------------------------------------- shifted linear term


def _indicator_inputs(T):
    """Dk = 1 keys of ones and one-hot values e_j, so an output row lists the positions that reached it."""
    ones = jnp.ones((1, T, 1, 1))
    return ones, ones, jnp.eye(T)[None, :, None, :]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), compiler_options=FAST_COMPILE)
def _coverage(T, sinks, window, chunk):
    """Rows t of (linear output, window numerator) are indicators of the positions reaching y_t each way."""
    q, k, v = _indicator_inputs(T)
    k_lin, v_lin, g_lin = swa.shifted_linear_inputs(k, v, jnp.zeros((1, T, 1, 1)), sinks=sinks, window=window)
    through_linear, _ = gla.chunked(q, k_lin, v_lin, g_lin, scale=1.0, chunk=16)
    # q = 0: every score is 0, so the window numerator is the indicator of I_t.
    through_window = swa.chunked(jnp.zeros_like(q), k, v, sinks=sinks, window=window, chunk=chunk).numerator
    return through_linear, through_window


@pytest.mark.parametrize("T, sinks, window, chunk", [(80, 8, 56, 16), (80, 0, 64, 64), (40, 3, 5, 8),
                                                     (20, 4, 1, 16), (12, 2, 50, 16)])
def test_linear_state_and_window_cover_every_position_once(T, sinks, window, chunk):
    """For every t: {j reaching y_t through the shifted linear state} ∪ I_t = {0..t}, disjoint."""
    through_linear, through_window = _coverage(T, sinks, window, chunk)
    coverage = np.asarray(through_linear[0, :, 0] + through_window[0, :, 0])
    np.testing.assert_array_equal(coverage, np.tril(np.ones((T, T))))
    linear_set = np.asarray(through_linear[0, :, 0])
    for t in range(T):  # the linear set is exactly {s ≤ j ≤ t − w}
        assert set(np.flatnonzero(linear_set[t])) == set(range(sinks, t - window + 1))


def _explicit_linear_term(q, k, v, decay, sinks, window, scale):
    """y_t = scale Σ_{s≤j≤t−w} (q_t ⊙ Π_{j<i≤t−w} decay_i)·k_j v_j by loops (float64); decay [T, Dk]."""
    T = q.shape[0]
    y = np.zeros((T, v.shape[1]))
    for t in range(T):
        for j in range(sinks, t - window + 1):
            factor = np.prod(decay[j + 1:t - window + 1], axis=0)
            y[t] += scale * np.dot(q[t] * factor, k[j]) * v[j]
    return y


@pytest.mark.parametrize("mechanism", ["gla", "kgla"])
def test_shifted_linear_term_uses_the_original_gates_in_between(mechanism):
    T, sinks, window, D = 50, 3, 7, 8
    rng = np.random.default_rng(4)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v = normal(1, T, 1, D), normal(1, T, 1, D), normal(1, T, 1, D)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    log_alpha = jax.nn.log_sigmoid(2.0 + normal(1, T, 1, D))
    gates = (log_alpha,)
    decay = np.exp(np.asarray(log_alpha[0, :, 0], np.float64))
    if mechanism == "kgla":
        beta = jax.nn.sigmoid(normal(1, T, 1))
        gates = (log_alpha, beta)
        decay = decay * (1 - np.asarray(beta[0], np.float64) * np.asarray(k[0, :, 0], np.float64) ** 2)
    shifted = swa.shifted_linear_inputs(k, v, *gates, sinks=sinks, window=window)
    chunked = functools.partial({"gla": gla, "kgla": kgla}[mechanism].chunked, chunk=16)
    y, _ = jax.jit(chunked, compiler_options=FAST_COMPILE)(q, *shifted)
    f64 = lambda x: np.asarray(x[0, :, 0], np.float64)
    expected = _explicit_linear_term(f64(q), f64(k), f64(v), decay, sinks, window, D ** -0.5)
    assert relative_rms(y[0, :, 0], expected) <= 1e-5


@functools.partial(jax.jit, static_argnums=(4, 5, 6), compiler_options=FAST_COMPILE)
def _linear_term_in_pieces(q, k, v, g, split, sinks, window):
    """GLA on shifted inputs: [0, split) fresh, [split, T−1) from rings + carried state, then one decode step."""
    T = q.shape[1]
    whole = gla.chunked(q, *swa.shifted_linear_inputs(k, v, g, sinks=sinks, window=window), chunk=16)

    def history(x, stop):  # rings written with positions 0 .. stop−1, unrolled to positions stop−w .. stop−1
        ring = swa.write_ring(jnp.zeros((B, window) + x.shape[2:]), x[:, :stop], 0)
        return swa.unroll_ring(ring, stop)

    first, state = gla.chunked(q[:, :split], *swa.shifted_linear_inputs(
        k[:, :split], v[:, :split], g[:, :split], sinks=sinks, window=window), chunk=16)
    rest = slice(split, T - 1)
    second, state = gla.chunked(q[:, rest], *swa.shifted_linear_inputs(
        k[:, rest], v[:, rest], g[:, rest], sinks=sinks, window=window,
        history=tuple(history(x, split) for x in (k, v, g)), start=split), initial_state=state, chunk=16)
    last = T - 1
    k1, v1, g1 = swa.shifted_linear_inputs(k[:, last:], v[:, last:], g[:, last:], sinks=sinks, window=window,
                                           history=tuple(history(x, last) for x in (k, v, g)), start=last)
    third, state = gla.step(q[:, last], k1[:, 0], v1[:, 0], g1[:, 0], state=state)
    return (first, second, third, state), whole


@pytest.mark.parametrize("split", [5, 20, 44])
def test_shifted_linear_term_continues_from_ring_history(split):
    """Prefill [0, split), then the rest with the last `window` (k, v, log α) from rings as history and the
    carried linear state; then decode the last token with T = 1. Equals one pass."""
    T, sinks, window, D = 48, 4, 9, 8
    rng = np.random.default_rng(split)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k, v = normal(B, T, H, D), normal(B, T, 2, D), normal(B, T, 2, D)
    g = jax.nn.log_sigmoid(2.0 + normal(B, T, H, D))
    (first, second, third, state), (whole, whole_state) = _linear_term_in_pieces(q, k, v, g, split, sinks, window)
    assert relative_rms(jnp.concatenate([first, second, third[:, None]], axis=1), whole) <= 1e-5
    assert relative_rms(state, whole_state) <= 1e-5


@pytest.mark.parametrize("sinks", [0, 3])
def test_leaving_window_is_the_one_token_shifted_input(sinks):
    """Decode: reading the ring slot of position count − window (leaving_window) equals shifted_linear_inputs
    with T = 1 and the unrolled rings as history, before and after the rings wrap, sinks zeroed."""
    window, D = 7, 4
    rng = np.random.default_rng(sinks)
    rings = [jnp.zeros((B, window, 2, D)), jnp.zeros((B, window, 2, D)), jnp.zeros((B, window, H))]
    for count in range(3 * window):
        new = [jnp.asarray(rng.standard_normal((B, 1) + r.shape[2:]), jnp.float32) for r in rings]
        got = swa.leaving_window(rings, jnp.asarray(count, jnp.int32), sinks=sinks)
        want = swa.shifted_linear_inputs(*new, sinks=sinks, window=window, start=count,
                                         history=tuple(swa.unroll_ring(r, count) for r in rings))
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        rings = [swa.write_ring(r, x, count) for r, x in zip(rings, new)]


def test_bad_inputs_raise_readable_errors():
    q, k, v = _inputs(0, 10, 2)
    with pytest.raises(ValueError, match="window >= 1"):
        swa.chunked(q, k, v, sinks=2, window=0)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        swa.chunked(q[:, :, :3], k, v, sinks=2, window=4)
    cache = swa.empty_cache(B, 2, 16, 16, sinks=2, window=4)
    with pytest.raises(ValueError, match="cache holds"):
        swa.chunked(q, k, v, sinks=2, window=8, cache=cache)
    with pytest.raises(ValueError, match="history"):
        swa.shifted_linear_inputs(k, v, sinks=2, window=4, history=(k[:, :3], v[:, :3]), start=3)
