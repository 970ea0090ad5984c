"""K1 of the chunked Pallas kernels (chunk_intra_pallas.py), interpreted on this CPU.

Output by output against the batched XLA form of the same in-chunk work (gdn.in_chunk_xla, the
decay tree of decay.py) at fp32 tolerances: per-channel and scalar gates, hard resets (log α = −1000),
chunks of 16, 32 and 64 (one, two and four sub-chunks), GQA read through the index maps, and the
additive rule (no W, Ũ). Every call is jitted: the interpreted kernel compiles in a few seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import chunk_gates, gdn
from linjax.kernels.chunk_intra_pallas import intra_chunk, unit_lower_inverse
from tests.kernels.test_pallas import assert_close

B, H = 1, 2


def token_inputs(seed, N, C, Dk, Dv, *, kv_heads=H, scalar_gate=False, resets=False):
    """[B, T, heads, D] inputs: unit keys, gates spread over (−20, 0] (−1000 on every 8th token when
    `resets`), β in (0, 1)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    T = N * C
    q = jax.random.normal(ks[0], (B, T, H, Dk))
    k = jax.random.normal(ks[1], (B, T, kv_heads, Dk))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, kv_heads, Dv))
    log_gate = jax.nn.log_sigmoid(4 * jax.random.normal(ks[3], (B, T, H, 1 if scalar_gate else Dk)) + 2)
    if resets:
        log_gate = log_gate.at[:, 3::8].set(-1000.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, log_gate, beta


def blocks(x, C):
    """[B, T, h, D] -> [N, B, h, C, D], the layout of gdn.in_chunk_xla."""
    Bx, T, h, D = x.shape
    return x.reshape(Bx, T // C, C, h, D).transpose(1, 0, 3, 2, 4)


def xla_in_chunk(q, k, v, log_gate, beta, C):
    """gdn.in_chunk_xla on the same (clamped) gates, keys and values repeated to the query heads, back in
    the kernel's [B, T, H, ...] layout: (A^{qk}, W, Ũ, Q⊙Γ, K⊙e^{G_C − G}, Γ_C [B, N, H, Dg])."""
    repeat = lambda x: jnp.repeat(x, H // x.shape[2], axis=2)  # noqa: E731
    gate = jnp.broadcast_to(chunk_gates.clamp(log_gate), q.shape)
    out = gdn.in_chunk_xla(blocks(q, C), blocks(repeat(k), C), blocks(repeat(v), C), blocks(gate, C),
                           blocks(beta[..., None], C)[..., 0])
    tokens = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(B, -1, H, x.shape[-1])  # noqa: E731
    a_qk, w, u, qg, kg, decay = out
    return tokens(a_qk), tokens(w), tokens(u), tokens(qg), tokens(kg), decay.transpose(1, 0, 2, 3)


def run_kernel(q, k, v, log_gate, beta, C, *, delta=True, dtype=jnp.float32):
    b = chunk_gates.sub_chunk_cumsum(chunk_gates.clamp(log_gate))
    return intra_chunk(q.astype(dtype), k.astype(dtype), v.astype(dtype) if delta else None, b,
                       beta[..., None] if delta else None, chunk=C, scale=1.0, dtype=dtype, interpret=True)


# (N, C, Dk, Dv, kv heads, scalar gate, resets)
CASES = [(2, 64, 32, 64, 2, False, False), (2, 64, 16, 16, 1, True, True), (1, 32, 16, 32, 2, True, False),
         (1, 16, 16, 16, 1, False, True), (1, 64, 16, 16, 2, False, True)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "N{}-C{}-Dk{}-Dv{}-Hkv{}-{}-{}".format(
    *c[:5], "scalar" if c[5] else "chan", "resets" if c[6] else "smooth"))
def test_kernel_matches_the_xla_in_chunk_work(case):
    N, C, Dk, Dv, kv_heads, scalar_gate, resets = case
    args = token_inputs(1, N, C, Dk, Dv, kv_heads=kv_heads, scalar_gate=scalar_gate, resets=resets)
    got = jax.jit(lambda *a: run_kernel(*a, C))(*args)
    a_qk, w, u, qg, kg, decay = jax.jit(lambda *a: xla_in_chunk(*a, C))(*args)
    pairs = {"A^qk": (got.a_qk, a_qk), "W": (got.w, w), "U~": (got.u_tilde, u), "Q*Gamma": (got.q_gated, qg),
             "K*to_end": (got.k_gated, kg), "chunk decay": (got.gamma, decay[..., :got.gamma.shape[-1]])}
    for name, (g, want) in pairs.items():
        assert np.isfinite(np.asarray(g)).all(), name
        assert_close(g, want, 1e-5, name)


def test_the_additive_rule_has_scores_and_gated_q_k_only():
    q, k, v, log_gate, beta = token_inputs(2, 2, 32, 16, 16, kv_heads=1, resets=True)
    got = jax.jit(lambda *a: run_kernel(*a, 32, delta=False))(q, k, v, log_gate, beta)
    a_qk, _, _, qg, kg, decay = jax.jit(lambda *a: xla_in_chunk(*a, 32))(q, k, v, log_gate, beta)
    assert got.w is None and got.u_tilde is None and got.inverse is None
    assert_close((got.a_qk, got.q_gated, got.k_gated, got.gamma), (a_qk, qg, kg, decay), 1e-5)


def test_bf16_dots_stay_within_bf16_rounding():
    """With bf16 operands (a bf16 model), what the state pass and outputs read comes out in bf16,
    the backward's residuals (T⁻¹, A^{kk}) and the decays in fp32."""
    args = token_inputs(5, 2, 64, 32, 32, resets=True)
    got = jax.jit(lambda *a: run_kernel(*a, 64, dtype=jnp.bfloat16))(*args)
    assert [x.dtype for x in (got.a_qk, got.q_gated, got.k_gated, got.w, got.u_tilde)] == [jnp.bfloat16] * 5
    assert [x.dtype for x in (got.gamma, got.inverse, got.a_kk)] == [jnp.float32] * 3
    want = jax.jit(lambda *a: xla_in_chunk(*a, 64))(*args)
    for g, w in zip((got.a_qk, got.w, got.u_tilde, got.q_gated, got.k_gated), want):
        assert_close(g.astype(jnp.float32), w, 1e-2)


def test_the_unit_lower_inverse_by_powers_is_the_inverse():
    rng = np.random.default_rng(3)
    t = np.eye(16, dtype=np.float32) + np.tril(rng.normal(size=(16, 16)).astype(np.float32) * 0.3, -1)
    assert_close(unit_lower_inverse(jnp.asarray(t)), np.linalg.inv(t), 1e-6)
