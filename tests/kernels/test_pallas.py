"""The Pallas kernels (`<mech>.pallas`, run in the Pallas interpreter on CPU)
against each mechanism's `reference` recurrence: outputs, final states and
gradients. GLA, kGLA, GDN and linear attention run chunk_pallas.py (forward
and backward kernels), checked input by input against `jax.grad` through
their `chunked` twins at fp32 precision; its state passes are also checked
alone. The gradient tests against `reference` check the custom_vjp plumbing:
cotangent routing, GQA head sums, dtypes, a missing initial state.

Each kernel shape is its own interpret-mode compile, so instead of the full
product T ∈ {1, 15, 64, 200} × Hkv ∈ {1, 2, 4} × D ∈ {16, 64} × initial
state × dtype (96 cases per mechanism) GLA and GDN run a covering design:
all 12 (T, Hkv) pairs, each with one of four (D, initial state, dtype)
patterns forming an orthogonal array, so every pair of values of any two
axes appears. T = 1, 15, 64 share one compiled kernel (one padded chunk).
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from linjax.kernels import chunk_states, chunk_states_pallas, gdn, gla, kgla, linear_attn, pallas_common, swa
from tests.helpers import relative_rms

B, H = 2, 4
TOL = {"float32": 1e-5, "bfloat16": 5e-3}
GRAD_TOL = 1e-4

# (D, with initial state, dtype): strength-2 orthogonal array over three binary axes.
PATTERNS = [(16, False, "float32"), (16, True, "bfloat16"),
            (64, False, "bfloat16"), (64, True, "float32")]
GRID = [(T, Hkv, *PATTERNS[(i + j) % 4])
        for i, T in enumerate((1, 15, 64, 200)) for j, Hkv in enumerate((1, 2, 4))]
# Beyond the grid: two Dv blocks per head (Dv = 128 > 64), a dimension that is
# not a power of two (24 → padded to 32), four chunks with extreme gates.
EXTRA = [(130, 2, (16, 128), True, "float32"), (70, 4, 24, True, "float32")]
case_id = lambda c: f"T{c[0]}-Hkv{c[1]}-D{c[2]}-{'h0' if c[3] else 'noh0'}-{c[4]}"


def make_inputs(seed, T, Hkv, D, with_state, dtype, *, unit_keys=False, gate_spread=2.0):
    """Random q, k, v (dtype), per-channel log α = log σ(spread·z + 2), β = σ(z), h0 (fp32 or None)."""
    Dk, Dv = (D, D) if isinstance(D, int) else D
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, Dk))
    k = jax.random.normal(ks[1], (B, T, Hkv, Dk))
    if unit_keys:  # the delta rule expects L2-normalised keys
        q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, Hkv, Dv))
    log_alpha = jax.nn.log_sigmoid(gate_spread * jax.random.normal(ks[3], (B, T, H, Dk)) + 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    h0 = jax.random.normal(ks[5], (B, H, Dk, Dv)) if with_state else None
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), log_alpha, beta, h0


def assert_close(actual, expected, tol, what=""):
    for i, (a, e) in enumerate(zip(jax.tree.leaves(actual), jax.tree.leaves(expected))):
        err = relative_rms(a, e)
        assert err <= tol, f"{what} output {i}: relative RMS {err:.2e} > {tol:.0e}"


reference = {name: jax.jit(m.reference) for name, m in
             [("gla", gla), ("gdn", gdn), ("kgla", kgla), ("linear_attn", linear_attn)]}
swa_reference = jax.jit(swa.reference, static_argnames=("sinks", "window"))


# ---------------------------------------------------------------------- forward


@pytest.mark.parametrize("case", GRID + EXTRA, ids=case_id)
def test_gla_forward(case):
    q, k, v, log_alpha, _, h0 = make_inputs(1, *case)
    assert_close(gla.pallas(q, k, v, log_alpha, initial_state=h0),
                 reference["gla"](q, k, v, log_alpha, initial_state=h0), TOL[case[4]])


@pytest.mark.parametrize("case", GRID + EXTRA, ids=case_id)
def test_gdn_forward(case):
    q, k, v, log_alpha, beta, h0 = make_inputs(2, *case, unit_keys=True)
    assert_close(gdn.pallas(q, k, v, log_alpha, beta, initial_state=h0),
                 reference["gdn"](q, k, v, log_alpha, beta, initial_state=h0), TOL[case[4]])


@pytest.mark.parametrize("gates", ["spread", "resets"])
@pytest.mark.parametrize("mech", ["gla", "gdn"])
def test_extreme_gates(mech, gates):
    """log α spread over (−20, 0], or hard resets (log α = −1000 every 8th
    step): decays must neither overflow nor lose precision to cancellation."""
    q, k, v, log_alpha, beta, h0 = make_inputs(3, 200, 2, 16, True, "float32",
                                               unit_keys=True, gate_spread=8.0)
    if gates == "resets":
        log_alpha = log_alpha.at[:, ::8].set(-1000.0)
    gates = (log_alpha,) if mech == "gla" else (log_alpha, beta)
    module = gla if mech == "gla" else gdn
    out = module.pallas(q, k, v, *gates, initial_state=h0)
    assert all(np.isfinite(np.asarray(x)).all() for x in out)
    assert_close(out, reference[mech](q, k, v, *gates, initial_state=h0), TOL["float32"])


@pytest.mark.parametrize("case", [GRID[11], GRID[9]], ids=case_id)
def test_gdn_scalar_gate_forward(case):
    q, k, v, log_alpha, beta, h0 = make_inputs(4, *case, unit_keys=True)
    scalar = log_alpha[..., 0]  # [B, T, H]
    assert_close(gdn.pallas(q, k, v, scalar, beta, initial_state=h0),
                 reference["gdn"](q, k, v, scalar, beta, initial_state=h0), TOL[case[4]])


@pytest.mark.parametrize("case", [GRID[10], GRID[1]], ids=case_id)
def test_kgla_forward(case):
    q, k, v, log_alpha, beta, h0 = make_inputs(5, *case, unit_keys=True)
    assert_close(kgla.pallas(q, k, v, log_alpha, beta, initial_state=h0),
                 reference["kgla"](q, k, v, log_alpha, beta, initial_state=h0), TOL[case[4]])


@pytest.mark.parametrize("case", [(200, 2, 16, True, "float32"), (15, 4, 64, False, "bfloat16")],
                         ids=case_id)
def test_linear_attn_forward(case):
    q, k, v, _, _, _ = make_inputs(6, *case)
    T, Hkv, D, with_state, _ = case
    # Positive features, as Hedgehog's softmax feature maps give.
    q, k = (jax.nn.softmax(x.astype(jnp.float32), -1).astype(x.dtype) for x in (q, k))
    h0 = jnp.abs(jax.random.normal(jax.random.PRNGKey(7), (B, H, D, D + 1))) if with_state else None
    assert_close(linear_attn.pallas(q, k, v, initial_state=h0),
                 reference["linear_attn"](q, k, v, initial_state=h0), TOL[case[4]])


# (T, Hkv, D, sinks, window, dtype): every T, Hkv and D, sinks inside / beyond
# one block, no sinks, a window wider than T.
SWA_CASES = [(1, 1, 16, 8, 56, "float32"), (15, 2, 64, 4, 4, "bfloat16"),
             (64, 4, 16, 0, 64, "float32"), (200, 2, 64, 8, 56, "float32"),
             (200, 1, 16, 70, 5, "bfloat16"), (130, 4, 64, 0, 1000, "float32")]


@pytest.mark.parametrize("case", SWA_CASES, ids=lambda c: "T{}-Hkv{}-D{}-s{}-w{}-{}".format(*c))
def test_swa_forward(case):
    T, Hkv, D, sinks, window, dtype = case
    q, k, v, _, _, _ = make_inputs(8, T, Hkv, D, False, dtype)
    assert_close(swa.pallas(q, k, v, sinks=sinks, window=window),
                 swa_reference(q, k, v, sinks=sinks, window=window), TOL[dtype])


# --------------------------------------------------------------------- backward
#
# fp32 only (the tolerance is for fp32 gradients). Every T, Hkv and D value
# appears, each with and without an initial state, across the GLA and GDN cases.

BACKWARD = [(1, 4, 64, True), (15, 1, 16, False), (64, 2, 64, False), (200, 2, 16, True)]


def check_vjp(pallas_fn, reference_fn, args, seed):
    """VJPs of both functions with the same random cotangents, compiled with jit."""
    out = jax.eval_shape(reference_fn, *args)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(out)))
    leaves = [jax.random.normal(key, o.shape, o.dtype) for key, o in zip(keys, jax.tree.leaves(out))]
    cotangent = jax.tree.unflatten(jax.tree.structure(out), leaves)
    # The Pallas side runs eagerly, so its forward reuses the kernel compiled
    # by the forward tests; its backward (chunked) is jitted inside.
    pallas_grads = jax.vjp(pallas_fn, *args)[1](cotangent)
    reference_grads = jax.jit(lambda a, ct: jax.vjp(reference_fn, *a)[1](ct))(args, cotangent)
    assert_close(pallas_grads, reference_grads, GRAD_TOL, "gradient")


@pytest.mark.parametrize("case", BACKWARD, ids=lambda c: "T{}-Hkv{}-D{}-{}".format(*c))
def test_gla_backward(case):
    q, k, v, log_alpha, _, h0 = make_inputs(9, *case, "float32")
    fn = lambda m: lambda *a: m(*a[:4], initial_state=a[4])
    check_vjp(fn(gla.pallas), fn(gla.reference), (q, k, v, log_alpha, h0), 10)


# The GLA and GDN backward kernels against autodiff through `chunked`, input by
# input (q, k, v, log α, β, initial state), with random cotangents of o and of
# the final state: T not a multiple of the chunk, GQA, two Dv blocks (Dv = 128),
# Dk not a power of two, no initial state, and hard resets (log α = −1000)
# among gates near −0.01.
KERNEL_GRAD_TOL = 1e-5
KERNEL_BACKWARD = [(130, 2, (16, 128), True, "smooth"), (200, 2, 16, True, "resets"),
                       (70, 2, 24, False, "smooth"), (15, 1, 64, True, "resets")]


def gla_gates(log_alpha, kind):
    if kind == "smooth":
        return log_alpha
    near_keep = -0.01 * jnp.exp(log_alpha)  # ≈ −0.01, per channel
    resets = jax.random.bernoulli(jax.random.PRNGKey(23), 0.15, log_alpha.shape)
    return jnp.where(resets, -1000.0, near_keep).at[:, 8::16].set(-1000.0)


def check_grads_per_input(pallas_fn, chunked_fn, args, seed, tol=KERNEL_GRAD_TOL):
    out = jax.eval_shape(chunked_fn, *args)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(out)))
    leaves = [jax.random.normal(key, o.shape, o.dtype) for key, o in zip(keys, jax.tree.leaves(out))]
    cotangent = jax.tree.unflatten(jax.tree.structure(out), leaves)
    got = jax.vjp(pallas_fn, *args)[1](cotangent)
    want = jax.jit(lambda a, ct: jax.vjp(chunked_fn, *a)[1](ct))(args, cotangent)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"input {i}: gradient presence differs"
        if w is not None:
            assert np.isfinite(np.asarray(g)).all(), f"input {i}: non-finite gradient"
            assert_close(g, w, tol, f"gradient of input {i}")


@pytest.mark.parametrize("case", KERNEL_BACKWARD, ids=lambda c: "T{}-Hkv{}-D{}-h0{}-{}".format(*c))
def test_gla_backward_kernel_matches_chunked(case):
    T, Hkv, D, with_state, gates = case
    q, k, v, log_alpha, _, h0 = make_inputs(22, T, Hkv, D, with_state, "float32")
    fn = lambda m: lambda *a: m(*a[:4], initial_state=a[4])
    check_grads_per_input(fn(gla.pallas), fn(gla.chunked), (q, k, v, gla_gates(log_alpha, gates), h0), 24)


@pytest.mark.parametrize("case", KERNEL_BACKWARD, ids=lambda c: "T{}-Hkv{}-D{}-h0{}-{}".format(*c))
def test_gdn_backward_kernel_matches_chunked(case):
    T, Hkv, D, with_state, gates = case
    q, k, v, log_alpha, beta, h0 = make_inputs(28, T, Hkv, D, with_state, "float32", unit_keys=True)
    fn = lambda m: lambda *a: m(*a[:5], initial_state=a[5])
    check_grads_per_input(fn(gdn.pallas), fn(gdn.chunked), (q, k, v, gla_gates(log_alpha, gates), beta, h0), 29)


def test_gdn_scalar_gate_backward_kernel_matches_chunked():
    q, k, v, log_alpha, beta, h0 = make_inputs(30, 130, 2, (16, 128), True, "float32", unit_keys=True)
    fn = lambda m: lambda *a: m(*a[:5], initial_state=a[5])
    check_grads_per_input(fn(gdn.pallas), fn(gdn.chunked), (q, k, v, log_alpha[..., 0], beta, h0), 31)


def test_kgla_backward_through_the_gla_kernel_matches_chunked():
    """kGLA differentiates its combined gate (plain JAX) through GLA's kernel log-gate gradient."""
    q, k, v, log_alpha, beta, h0 = make_inputs(25, 130, 2, 16, True, "float32", unit_keys=True)
    fn = lambda m: lambda *a: m(*a[:5], initial_state=a[5])
    check_grads_per_input(fn(kgla.pallas), fn(kgla.chunked), (q, k, v, log_alpha, beta, h0), 26)


@pytest.mark.parametrize("delta, decay", [(True, "chan"), (False, "scalar"), (False, None)])
def test_state_passes_match_the_scan(delta, decay):
    """K2 (chunk_states_pallas.forward_states) against chunk_states.scan: states, new values and final
    state; and its reverse pass against autodiff of the XLA forward (scan, then o = q̃ S_n + A U_n):
    ∂L/∂U (∂L/∂values) and ∂L/∂initial state. fp32; three chunks of 16, GQA for the additive rule's
    values, Dv 64 in value blocks."""
    N, C, Dk, Dv, Hs = 3, 16, 32, 64, 2
    T = N * C
    ks = jax.random.split(jax.random.PRNGKey(40), 9)
    k_gated = jax.random.normal(ks[0], (1, T, Hs, Dk)) / 4
    values = jax.random.normal(ks[1], (1, T, Hs if delta else 1, Dv))
    w = jax.random.normal(ks[2], (1, T, Hs, Dk)) / 8 if delta else None
    gamma = {"chan": jax.random.uniform(ks[3], (1, N, Hs, Dk)), "scalar": jax.random.uniform(ks[3], (1, N, Hs, 1)),
             None: None}[decay]
    state = jax.random.normal(ks[4], (1, Hs, Dk, Dv))
    q_gated = jax.random.normal(ks[5], (1, T, Hs, Dk)) / 4
    a_qk = jnp.tril(jax.random.normal(ks[6], (1, N, Hs, C, C))).transpose(0, 1, 3, 2, 4).reshape(1, T, Hs, C)

    def xla(values, state):
        blocks = lambda x: x.reshape(1, N, C, Hs, x.shape[-1]).transpose(1, 0, 3, 2, 4)  # noqa: E731
        full = jnp.repeat(values, Hs // values.shape[2], axis=2)
        g = None if gamma is None else gamma.transpose(1, 0, 2, 3)
        states, u, final = chunk_states.scan(blocks(k_gated), blocks(full), None if w is None else blocks(w), g, state)
        o = blocks(q_gated) @ states + blocks(a_qk) @ u
        tokens = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(1, T, Hs, x.shape[-1])  # noqa: E731
        return states.transpose(1, 0, 2, 3, 4), tokens(u), final, tokens(o)

    states, u, final = jax.jit(lambda *a: chunk_states_pallas.forward_states(
        *a, chunk=C, dtype=jnp.float32, interpret=True))(k_gated, values, w, gamma, state)
    want_states, want_u, want_final, _ = jax.jit(xla)(values, state)
    assert_close((states, final), (want_states, want_final), 1e-5, "forward state pass")
    if delta:
        assert_close(u, want_u, 1e-5, "new values")
    d_out, d_final = jax.random.normal(ks[7], (1, T, Hs, Dv)), jax.random.normal(ks[8], (1, Hs, Dk, Dv))
    _, d_u, d_state = jax.jit(lambda *a: chunk_states_pallas.reverse_states(
        *a, chunk=C, dtype=jnp.float32, interpret=True))(d_out, a_qk, q_gated, k_gated, w, gamma, d_final)
    want_d_values, want_d_state = jax.jit(lambda: jax.vjp(lambda v, s: xla(v, s)[2:], values, state)[1](
        (d_final, d_out)))()
    if not delta:  # per query head, summed over the heads sharing a value head
        d_u = d_u.reshape(1, T, 1, Hs, Dv).sum(3)
    assert_close((d_u, d_state), (want_d_values, want_d_state), 1e-5, "reverse state pass")


def pallas_call_names(fn, *args):
    names = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                names.append(str(eqn.params.get("name", eqn.params.get("name_and_src_info"))))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@pytest.mark.parametrize("mech", ["gla", "gdn"])
def test_gradient_runs_the_backward_kernels(mech):
    """The gradient program contains the Pallas reverse state pass (not autodiff of a scan)."""
    q, k, v, log_alpha, beta, h0 = make_inputs(27, 70, 2, 16, True, "float32", unit_keys=True)
    module, gates = (gla, (log_alpha,)) if mech == "gla" else (gdn, (log_alpha, beta))
    n = 3 + len(gates)

    def loss(*a):
        o, state = module.pallas(*a[:n], initial_state=a[n])
        return jnp.sum(o) + jnp.sum(state)

    names = pallas_call_names(jax.grad(loss, argnums=tuple(range(n + 1))), q, k, v, *gates, h0)
    assert any("linjax_chunk_states_bwd" in n for n in names), names


@pytest.mark.parametrize("case", BACKWARD[::-1], ids=lambda c: "T{}-Hkv{}-D{}-{}".format(*c))
def test_gdn_backward(case):
    q, k, v, log_alpha, beta, h0 = make_inputs(11, *case, "float32", unit_keys=True)
    fn = lambda m: lambda *a: m(*a[:5], initial_state=a[5])
    check_vjp(fn(gdn.pallas), fn(gdn.reference), (q, k, v, log_alpha, beta, h0), 12)


def test_gdn_scalar_gate_backward():
    q, k, v, log_alpha, beta, h0 = make_inputs(13, 70, 2, 16, True, "float32", unit_keys=True)
    fn = lambda m: lambda *a: m(*a[:5], initial_state=a[5])
    check_vjp(fn(gdn.pallas), fn(gdn.reference), (q, k, v, log_alpha[..., 0], beta, h0), 14)


def test_kgla_backward():
    q, k, v, log_alpha, beta, h0 = make_inputs(15, 70, 2, 16, True, "float32", unit_keys=True)
    fn = lambda m: lambda *a: m(*a[:5], initial_state=a[5])
    check_vjp(fn(kgla.pallas), fn(kgla.reference), (q, k, v, log_alpha, beta, h0), 16)


def test_linear_attn_backward():
    q, k, v, _, _, _ = make_inputs(17, 70, 2, 16, False, "float32")
    q, k = jax.nn.softmax(q, -1), jax.nn.softmax(k, -1)
    fn = lambda m: lambda *a: m(*a)
    check_vjp(fn(linear_attn.pallas), fn(linear_attn.reference), (q, k, v), 18)


@pytest.mark.parametrize("sinks, window", [(8, 56), (70, 5)])
def test_swa_backward(sinks, window):
    q, k, v, _, _, _ = make_inputs(19, 130, 2, 16, False, "float32")
    fn = lambda m: lambda *a: m(*a, sinks=sinks, window=window).normalized()
    check_vjp(fn(swa.pallas), fn(swa.reference), (q, k, v), 20)


# ------------------------------------------------------------------ the wrapper


def test_the_pallas_form_follows_the_lowering_platform():
    """interpret=None: a CPU lowering runs the interpreter (no Triton call), a CUDA lowering made on this
    CPU machine holds the Triton kernels; True / False force one."""
    q, k, v, log_alpha, beta, _ = make_inputs(21, 15, 2, 16, False, "float32", unit_keys=True)
    lowered = lambda platform, **kw: jax.jit(lambda *a: gdn.pallas(*a, **kw)).trace(  # noqa: E731
        q, k, v, log_alpha, beta).lower(lowering_platforms=(platform,)).as_text()
    assert "triton" not in lowered("cpu")
    assert "__gpu$xla.gpu.triton" in lowered("cuda")
    assert "triton" not in lowered("cuda", interpret=True)
    assert pallas_common.by_platform(lambda x, interpret: interpret, 0.0, interpret=False) is False


def test_bad_inputs_raise_readable_errors():
    q, k, v, log_alpha, beta, _ = make_inputs(21, 15, 3, 16, False, "float32")
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        gla.pallas(q, k, v, log_alpha)
    q, k, v, log_alpha, beta, _ = make_inputs(21, 15, 2, 16, False, "float32")
    with pytest.raises(ValueError, match="log_alpha must be"):
        gla.pallas(q, k, v, log_alpha[:, :, :2])
    with pytest.raises(ValueError, match="beta must be"):
        gdn.pallas(q, k, v, log_alpha, beta[..., :1])
    with pytest.raises(ValueError, match="power of two ≥ 16"):
        gla.pallas(q, k, v, log_alpha, chunk=24)
    with pytest.raises(ValueError, match="power of two ≥ 16"):
        gdn.pallas(q, k, v, log_alpha, beta, chunk=8)
    with pytest.raises(NotImplementedError, match="prefill"):
        swa.pallas(q, k, v, sinks=2, window=4,
                   cache=swa.empty_cache(B, 2, 16, 16, sinks=2, window=4))
